#!/usr/bin/env bash
# The GPU service benchmark in one device call, from the repository root (the working tree is copied there,
# not pip-installed; the service's missing packages travel as wheels in .whl/, named in the call's carry):
#
#     bash bench/device/run_service_bench.sh [TOTAL_S=540]
#
# Steps, each bounded by `timeout` so the whole script ends within TOTAL_S and $OUT always holds what was
# measured so far: install the wheels into /tmp/site; check imports and the dependency closure; the GPU's line
# from nvidia-smi; the UMT5-XXL-geometry text-encode timing; the service benchmark (which writes its JSON after
# every case). Files left in $OUT: run.log, wheels.json, text_encode.json, service.json, service.stderr,
# server.log. Overrides, as environment variables:
#   SERVER_ARGS  arguments of `arstream serve` (default: the 1.3B preset on CUDA in bf16, random weights)
#   BENCH_ARGS   extra arguments of bench/bench_service_gpu.py (e.g. "--duration 60 --concurrency 1,2")
#   TEXT_ENCODE  0 skips the text-encode timing; TEXT_ENCODE_ARGS its extra arguments
#   PYTHON       the interpreter (default python3, the image's, which holds torch)
set -u -o pipefail
TOTAL=${1:-540}
OUT=${OUT:-$PWD/out-device}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

left() { echo $(( TOTAL - SECONDS )); }
cap() { local want=$1 reserve=${2:-0} have; have=$(( $(left) - reserve )); (( have < want )) && want=$have; (( want < 1 )) && want=1; echo "$want"; }

main() {
  echo "== $(date -u +%FT%TZ) run_service_bench.sh, total ${TOTAL}s, repo $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  if ls .whl/*.whl >/dev/null 2>&1; then
    timeout "$(cap 120)" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || { echo "wheel install failed"; return 1; }
  else
    echo "no .whl/ here: using the image's packages only (name .whl in the call's carry)"
  fi
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
  echo "== $(left)s left: imports"
  timeout "$(cap 120)" "$PY" -c 'import fastapi, diffusers, av, uvicorn, websockets, pydantic_settings, torch
print("imports ok; torch", torch.__version__, "cuda", torch.cuda.is_available(), "fastapi", fastapi.__version__, "av", av.__version__)' \
    || { echo "imports failed"; return 1; }
  timeout "$(cap 60)" "$PY" bench/device/check_wheels.py --installed > "$OUT/wheels.json" \
    || echo "check_wheels reports problems (see wheels.json); going on"
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm --format=csv,noheader || true

  # The service bench needs most of the time: the text encode gets at most 150 s and leaves it 240 s.
  local encode_s; encode_s=$(cap 150 240)
  if [ "${TEXT_ENCODE:-1}" != 0 ] && (( encode_s >= 30 )); then
    echo "== $(left)s left: text encode (UMT5-XXL geometry), at most ${encode_s}s"
    timeout -k 10 "$encode_s" "$PY" bench/text_encode_gpu.py ${TEXT_ENCODE_ARGS:-} > "$OUT/text_encode.json" \
      || echo "text encode failed or timed out"
    cat "$OUT/text_encode.json"
  else
    echo "text encode skipped"
  fi

  local server_args=${SERVER_ARGS:-"--preset wan2.1-1.3b --device cuda --dtype bfloat16"}
  if [ -z "${SERVER_ARGS:-}" ] && timeout "$(cap 90 240)" "$PY" -m app.cli serve --help 2>/dev/null | grep -q -- --random-weights; then
    server_args="$server_args --random-weights"
  fi
  local budget=$(( $(left) - 20 ))
  echo "== $(left)s left: service bench, budget ${budget}s, server: $server_args"
  # shellcheck disable=SC2086  # the argument strings are word lists on purpose
  timeout -k 20 "$(( budget + 10 ))" "$PY" bench/bench_service_gpu.py --budget-s "$budget" \
    --out "$OUT/service.json" --server-log "$OUT/server.log" --text-encode-json "$OUT/text_encode.json" \
    ${BENCH_ARGS:-} -- $server_args > "$OUT/service.stdout" 2> >(tee "$OUT/service.stderr" >&2)
  echo "service bench exit $?"
  rm -f "$OUT/service.stdout"  # the same line as service.json
  # The JSON is long; the call's output tail shows the summary (service.json comes back whole).
  "$PY" - "$OUT/service.json" <<'EOF' || true
import json, sys
r = json.load(open(sys.argv[1]))
print(json.dumps({"complete": r.get("complete"), "headline": r.get("headline"), "startup": r.get("startup"),
                  "startup_error": r.get("startup_error"), "engine_only": r.get("engine_only"),
                  "skipped": r.get("skipped"), "cases": {k: v["summary"] for k, v in r.get("cases", {}).items()}}))
EOF
  echo "== done, $(left)s left"
}

main 2>&1 | tee "$OUT/run.log"
status=${PIPESTATUS[0]}
# Bound what comes back (16 MiB a file): the server's log keeps its last 8 MiB.
if [ -f "$OUT/server.log" ] && [ "$(stat -c %s "$OUT/server.log")" -gt 8388608 ]; then
  tail -c 8388608 "$OUT/server.log" > "$OUT/server.log.tmp" && mv "$OUT/server.log.tmp" "$OUT/server.log"
fi
exit "$status"
