#!/usr/bin/env bash
# The sixth session's device calls (the device tool: carry .whl), in at most 600 s:
#
#     PARTS="tests fast_fp8 fast_fp8_one standard_fp8" bash bench/device/run_in_flight.sh [TOTAL_S=585]
#
# Parts, in the order given (default: the first call's four):
#   tests         the GPU tests: a steady block is dispatched without a host sync (and streams what a synchronous
#                 run streams), the fast paths, FP8 attention in the engine;
#   fast_fp8      the service, fast window + TAEHV, --fp8 attention, two blocks in flight (the default on CUDA):
#                 first session after /readyz (FIRST_S, default 12 s), two and three paced viewers;
#   fast_fp8_one  the same with one block in flight (the previous behaviour): the reference, in the same run;
#   standard_fp8  standard window + Wan VAE, --fp8 attention: pacing off and on, transitions;
#   fast_bf16     fast window + TAEHV, bf16: first session, two paced viewers;
#   standard_bf16 standard window + Wan VAE, bf16: pacing off and on, transitions.
# Real websockets clients against `arstream serve` (bench/bench_service_gpu.py); files in $OUT: each part's JSON,
# the test log and one tarball of the server logs.
set -u -o pipefail
# shellcheck source=bench/device/common.sh
. bench/device/common.sh
start_run "${1:-585}"
SERVER=(--preset wan2.1-1.3b --device cuda --dtype bfloat16 --random-weights)
FAST=(--concurrency 2,3 --pacing on --duration 14 --first-duration "${FIRST_S:-12}" --no-transitions)
STANDARD=(--concurrency 1 --pacing off,on --duration 12 --first-duration 12 --transitions-duration 16)
for part in ${PARTS:-tests fast_fp8 fast_fp8_one standard_fp8}; do
  case $part in
    tests)
      gpu_tests "${TESTS_S:-100}" tests/test_blocks_in_flight.py tests/test_fast_paths.py \
        tests/test_fp8_attention_engine.py ;;
    fast_fp8)
      ARSTREAM_ENGINE__FP8=attention ARSTREAM_ENGINE__VIDEO_DECODER=taehv service fast_fp8 "${FAST_FP8_S:-150}" \
        "${FAST[@]}" -- "${SERVER[@]}" --window-frames 6 ;;
    fast_fp8_one)
      ARSTREAM_ENGINE__FP8=attention ARSTREAM_ENGINE__VIDEO_DECODER=taehv ARSTREAM_ENGINE__BLOCKS_IN_FLIGHT=1 \
        service fast_fp8_one_in_flight "${SERIAL_S:-90}" --concurrency 1 --pacing off --duration 8 --first-duration 12 \
        --no-transitions -- "${SERVER[@]}" --window-frames 6 ;;
    standard_fp8)
      ARSTREAM_ENGINE__FP8=attention service standard_fp8 "${STANDARD_FP8_S:-$(( $(left) - 25 ))}" \
        "${STANDARD[@]}" -- "${SERVER[@]}" ;;
    fast_bf16)
      ARSTREAM_ENGINE__VIDEO_DECODER=taehv service fast_bf16 "${FAST_BF16_S:-100}" \
        --concurrency 2 --pacing on --duration 14 --first-duration 12 --no-transitions -- "${SERVER[@]}" \
        --window-frames 6 ;;
    standard_bf16)
      service standard_bf16 "${STANDARD_BF16_S:-$(( $(left) - 25 ))}" "${STANDARD[@]}" -- "${SERVER[@]}" ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
echo "== done, $(left)s left"
