#!/usr/bin/env bash
# The closing GPU run of the performance work, in one device call (the device tool: carry .whl):
#
#     bash bench/device/run_final.sh [TOTAL_S=560]
#
# 1. engine only: the landed per-forward path, the engine's path and the naive concatenated-KV path, per
#    forward and per block, plus a profile of the engine's block (bench/bench_fast_paths.py);
# 2. the service, standard window, full Wan VAE (the standard benchmark), real WebSocket clients;
# 3. the service, fast window with the TAEHV decoder, several paced viewers;
# 4. (FP8_FAST_S set) the same with --fp8 attention.
# Everything lands in $OUT as at most 8 files: the JSON of each part and one tarball of the logs.
set -u -o pipefail
# shellcheck source=bench/device/common.sh
. bench/device/common.sh
start_run "${1:-560}"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader || true

if [ "${ENGINE:-1}" = 1 ]; then  # ENGINE=0: the services only
  echo "== $(left)s left: engine fast paths"
  # shellcheck disable=SC2086
  timeout -k 5 "${FAST_S:-110}" python3 bench/bench_fast_paths.py ${FAST_ARGS:---sections forward,profile --blocks 6 \
    --variants landed,engine --no-compile-decoder} --out "$OUT/fast.jsonl" > /dev/null 2> "$OUT/logs/fast.stderr"
  echo "fast paths exit $?"; tail -n 1 "$OUT/fast.jsonl" | cut -c1-2500
  [ -f "$OUT/fast_profile.txt" ] && mv "$OUT/fast_profile.txt" "$OUT/logs/"
fi

if [ -n "${QUALITY_ARGS:-}" ]; then  # FP8 variants against bf16 (bench/fp8_quality.py), when asked for
  echo "== $(left)s left: fp8 quality"
  # shellcheck disable=SC2086
  timeout -k 5 "${QUALITY_S:-90}" python3 bench/fp8_quality.py $QUALITY_ARGS --out "$OUT/fp8_quality.jsonl" \
    > /dev/null 2> "$OUT/logs/fp8_quality.stderr"
  echo "fp8 quality exit $?"; tail -n 1 "$OUT/fp8_quality.jsonl" 2>/dev/null | cut -c1-2500
fi

# shellcheck disable=SC2086  # the argument strings are word lists on purpose
run_standard() {
  service standard "${STANDARD_S:-250}" ${STANDARD_ARGS:---concurrency 1,2 --pacing on,off --duration 14 \
    --first-duration 12 --transitions-duration 16} -- --preset wan2.1-1.3b --device cuda --dtype bfloat16 --random-weights
}
# shellcheck disable=SC2086
run_fast() {
  ARSTREAM_ENGINE__VIDEO_DECODER=taehv service fast_taehv "${1:-$(( $(left) - 25 ))}" ${FAST_SERVICE_ARGS:---concurrency \
    2,3,1 --pacing on --duration 14 --first-duration 10 --no-transitions} -- --preset wan2.1-1.3b --device cuda \
    --dtype bfloat16 --random-weights --window-frames 6
}
# FP8_FAST_S / FP8_FAST_ARGS: also the fast window with --fp8 attention (its own server), after the others.
# shellcheck disable=SC2086
run_fast_fp8() {
  ARSTREAM_ENGINE__VIDEO_DECODER=taehv ARSTREAM_ENGINE__FP8=attention service fast_taehv_fp8 "$1" \
    ${FP8_FAST_ARGS:---concurrency 2 --pacing on --duration 60 --first-duration 10 --no-transitions} -- \
    --preset wan2.1-1.3b --device cuda --dtype bfloat16 --random-weights --window-frames 6
}
if [ "${FAST_FIRST:-0}" = 1 ]; then run_fast "${FAST_SERVICE_S:-140}"; run_standard; else
  run_standard; run_fast "${FAST_SERVICE_S:-$(( $(left) - 25 ))}"; fi
if [ -n "${FP8_FAST_S:-}" ]; then run_fast_fp8 "$(( FP8_FAST_S < $(left) - 25 ? FP8_FAST_S : $(left) - 25 ))"; fi

tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
ls -la "$OUT"
echo "== done, $(left)s left"
