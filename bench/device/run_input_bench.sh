#!/usr/bin/env bash
# Pictures and video in (issue 22) on one H200 in one device call, from the repository root; the service's
# missing packages travel as wheels in .whl/ (name it in the call's carry), as for run_service_bench.sh:
#
#     bash bench/device/run_input_bench.sh [TOTAL_S=560]
#
# Runs bench/bench_input_gpu.py against `arstream serve` (1.3B geometry, random bf16 weights, 832x480, the Wan
# VAE): image -> video time to first media next to text's, live video -> video frames/s and added device time per
# block at two strengths, then the streaming encoders alone (cost per block, state bytes). Files left in $OUT:
# input.json (written after every case, `complete` false until the end), server.log, input.stderr, run.log.
# SERVER_ARGS overrides the server's arguments; BENCH_ARGS adds bench_input_gpu.py's (e.g. "--duration 20").
set -u -o pipefail
source bench/device/common.sh
start_run "${1:-560}"

main() {
  echo "== $(date -u +%FT%TZ) run_input_bench.sh, total ${TOTAL}s, repo $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader || true
  local server_args=${SERVER_ARGS:-"--preset wan2.1-1.3b --random-weights --device cuda --dtype bfloat16"}
  local budget=$(( $(left) - 30 ))
  echo "== $(left)s left: input bench, budget ${budget}s, server: $server_args"
  # shellcheck disable=SC2086  # the argument strings are word lists on purpose
  timeout -k 20 "$(( budget + 15 ))" python3 bench/bench_input_gpu.py --budget-s "$budget" \
    --out "$OUT/input.json" --server-log "$OUT/server.log" ${BENCH_ARGS:-} -- $server_args \
    > "$OUT/input.stdout" 2> >(tee "$OUT/input.stderr" >&2)
  echo "input bench exit $?"
  rm -f "$OUT/input.stdout"  # the same line as input.json
  python3 - "$OUT/input.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
cases = r.get("cases", {})
print(json.dumps({"complete": r.get("complete"), "startup": r.get("startup"),
                  "ttfm": {k: cases[k]["first_ms_median"] for k in ("text_ttfm", "image_ttfm") if k in cases},
                  "live": {k: {f: v.get(f) for f in ("fps", "steps", "denoise_ms_median", "decode_ms_median", "added_ms_per_block")}
                           for k, v in cases.items() if k.startswith(("live_", "text_pace"))},
                  "encoders": {k: v for k, v in (r.get("encoders") or {}).items() if k in ("wan2.1", "tiny-codec")}}))
PY
  echo "== done, $(left)s left"
}

main 2>&1 | tee "$OUT/run.log"
exit "${PIPESTATUS[0]}"
