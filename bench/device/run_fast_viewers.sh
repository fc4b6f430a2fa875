#!/usr/bin/env bash
# Issue 31, part 2: the fast config's paced viewers through the service, on the device in ONE call:
#
#     run(command="bash bench/device/run_fast_viewers.sh 560", carry=[".site.tar.xz"], timeout_s=600)
#
# For each FP8 mode of FAST_FP8 (default "all"): a fresh `arstream serve` of the fast config (1.3B random bf16 at
# 832x480, window 6, the TAEHV decoder), the first session after /readyz, then VIEWERS (default 3) paced
# viewers at once (realtime admission decides who is served). STANDARD=FP8 (e.g. all) also serves the standard
# window once, pacing off, after the fast ones. SERVICE_S: each server's budget (default 170: a cold first
# server needs 60-85 s to /readyz). Files in $OUT: service_*.json, logs/.
set -u -o pipefail
# shellcheck source=bench/device/common.sh
. bench/device/common.sh
start_run "${1:-560}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
SERVER=(--preset wan2.1-1.3b --device cuda --dtype bfloat16 --random-weights)
for fp8 in ${FAST_FP8:-all}; do
  budget=${SERVICE_S:-170}
  if [ "$(left)" -lt $(( budget + 15 )) ]; then echo "fast $fp8 skipped ($(left)s left)"; continue; fi
  ARSTREAM_ENGINE__FP8=$fp8 ARSTREAM_ENGINE__VIDEO_DECODER=taehv service "fast_fp8_$fp8" "$budget" \
    --concurrency "${VIEWERS:-3}" --pacing on --duration "${DURATION:-20}" --first-duration 10 --no-transitions \
    -- "${SERVER[@]}" --window-frames 6
done
if [ -n "${STANDARD:-}" ] && [ "$(left)" -gt 150 ]; then
  ARSTREAM_ENGINE__FP8=$STANDARD service "standard_fp8_$STANDARD" "$(( $(left) - 15 ))" \
    --concurrency 1 --pacing off --duration 12 --first-duration 12 --no-transitions -- "${SERVER[@]}"
fi
echo "== done, $(left)s left"
