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
# shellcheck source=bench/device/common.sh
. bench/device/common.sh
start_run "${1:-585}"
gpu_tests "${TESTS_S:-90}" tests/test_fast_paths.py tests/test_fp8_attention_engine.py
SERVER=(--preset wan2.1-1.3b --device cuda --dtype bfloat16 --random-weights)
ARSTREAM_ENGINE__VIDEO_DECODER=taehv ARSTREAM_ENGINE__FP8=attention service fast_fp8 "${FAST_FP8_S:-150}" \
  --concurrency 2,3 --pacing on --duration 14 --first-duration 12 --no-transitions -- "${SERVER[@]}" --window-frames 6
ARSTREAM_ENGINE__FP8=attention service standard_fp8 "${STANDARD_FP8_S:-190}" \
  --concurrency 1 --pacing off,on --duration 14 --first-duration 12 --transitions-duration 16 -- "${SERVER[@]}"
ARSTREAM_ENGINE__VIDEO_DECODER=taehv service fast_bf16 "$(( $(left) - 25 ))" \
  --concurrency 2 --pacing on --duration 14 --first-duration 12 --no-transitions -- "${SERVER[@]}" --window-frames 6
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
echo "== done, $(left)s left"
