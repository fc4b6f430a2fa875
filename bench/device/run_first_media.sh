#!/usr/bin/env bash
# Issue 23, part 1, on the device in ONE call (the device tool: carry .whl), in at most 600 s:
#
#     run(command="bash bench/device/run_first_media.sh 585", carry=[".whl"], timeout_s=600)
#
# 1. encoder_probe: a fresh process with CUDA initialised (as the server has it) opens each H.264 candidate in the
#    service's order, timed, with what each answers (h264_nvenc on an H200: the cost the first socket after
#    /readyz paid before the service warmed its encoders at start-up), then the service's warm-up at 832x480.
# 2. Three fresh `arstream serve` processes, the issue's configurations, 1.3B random bf16 at 832x480:
#      standard_bf16   standard window (3 + 15), Wan VAE
#      standard_fp8    the same, --fp8 attention
#      fast_fp8        fast window (3 + 6), TAEHV, --fp8 attention
#    each: the first session after /readyz (pacing off), then one later session pacing off and one paced, each
#    timed by an outside websockets client that sends `start` as soon as its socket is open (time to first
#    media from there, and from before the connect); the server's own time-to-first-media metric per case.
# 3. bench/first_media_summary.py: one line per server (first session's TTFM, later sessions', the server's,
#    the log's `media encoders warmed` and `session created` -> `session started` gaps) and whether every first
#    session met <= 250 ms.
# Files in $OUT: encoder_probe.json, service_*.json, first_media.json, logs.tar.gz (server logs).
set -u -o pipefail
# shellcheck source=bench/device/common.sh
. bench/device/common.sh
start_run "${1:-585}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
part encoder_probe 60 python3 bench/encoder_probe.py --cuda --width 832 --height 480
cat "$OUT/encoder_probe.stdout"; tail -n 3 "$OUT/encoder_probe.stderr"
SERVER=(--preset wan2.1-1.3b --device cuda --dtype bfloat16 --random-weights)
CASES=(--concurrency 1 --pacing off,on --duration 6 --first-duration 8 --no-transitions)
service standard_bf16 "${STANDARD_S:-150}" "${CASES[@]}" -- "${SERVER[@]}"
ARSTREAM_ENGINE__FP8=attention service standard_fp8 "${STANDARD_S:-150}" "${CASES[@]}" -- "${SERVER[@]}"
ARSTREAM_ENGINE__FP8=attention ARSTREAM_ENGINE__VIDEO_DECODER=taehv \
  service fast_fp8 "$(( $(left) - 20 ))" "${CASES[@]}" -- "${SERVER[@]}" --window-frames 6
python3 bench/first_media_summary.py \
  "standard_bf16=$OUT/service_standard_bf16.json:$OUT/logs/server_standard_bf16.log" \
  "standard_fp8=$OUT/service_standard_fp8.json:$OUT/logs/server_standard_fp8.log" \
  "fast_fp8=$OUT/service_fast_fp8.json:$OUT/logs/server_fast_fp8.log" | tee "$OUT/first_media.json"
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
echo "== done, $(left)s left"
