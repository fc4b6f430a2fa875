#!/usr/bin/env bash
# The fifth session's closing device call (the device tool: carry .whl), in at most 600 s:
#
#     bash bench/device/run_closing.sh [TOTAL_S=585]
#
# 1. the GPU tests of the fast paths and of FP8 attention in the engine;
# 2. the service, fast window + TAEHV, --fp8 attention: first session after /readyz, two and three paced viewers;
# 3. the service, standard window + Wan VAE, --fp8 attention: pacing off and on, transitions;
# 4. the service, fast window + TAEHV, bf16: first session, two paced viewers (in what time is left).
# Real websockets clients against `arstream serve` (bench/bench_service_gpu.py); files in $OUT: each part's JSON,
# the test log and one tarball of the server logs.
set -u -o pipefail
TOTAL=${1:-585}
OUT=${OUT:-$PWD/out-device}
mkdir -p "$OUT/logs"
left() { echo $(( TOTAL - SECONDS )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout -k 5 "${TESTS_S:-90}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fast_paths.py \
  tests/test_fp8_attention_engine.py > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests exit $?: $(tail -n 1 "$OUT/gpu_tests.txt")"
SERVER=(--preset wan2.1-1.3b --device cuda --dtype bfloat16 --random-weights)
service() {  # NAME BUDGET_S BENCH_ARGS... -- SERVER_ARGS...
  local name=$1 budget=$2; shift 2
  echo "== $(left)s left: service $name, budget ${budget}s"
  timeout -k 20 "$(( budget + 15 ))" python3 bench/bench_service_gpu.py --budget-s "$budget" --no-engine-reference \
    --out "$OUT/service_$name.json" --server-log "$OUT/logs/server_$name.log" "$@" \
    > /dev/null 2> "$OUT/logs/service_$name.stderr"
  echo "service $name exit $?"
  python3 - "$OUT/service_$name.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
print(json.dumps({"startup": r.get("startup"), "startup_error": r.get("startup_error"),
                  "cases": {k: v["summary"] for k, v in r.get("cases", {}).items()}})[:2200])
PY
}
ARSTREAM_ENGINE__VIDEO_DECODER=taehv ARSTREAM_ENGINE__FP8=attention service fast_fp8 "${FAST_FP8_S:-150}" \
  --concurrency 2,3 --pacing on --duration 14 --first-duration 12 --no-transitions -- "${SERVER[@]}" --window-frames 6
ARSTREAM_ENGINE__FP8=attention service standard_fp8 "${STANDARD_FP8_S:-190}" \
  --concurrency 1 --pacing off,on --duration 14 --first-duration 12 --transitions-duration 16 -- "${SERVER[@]}"
ARSTREAM_ENGINE__VIDEO_DECODER=taehv service fast_bf16 "$(( $(left) - 25 ))" \
  --concurrency 2 --pacing on --duration 14 --first-duration 12 --no-transitions -- "${SERVER[@]}" --window-frames 6
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
echo "== done, $(left)s left"
