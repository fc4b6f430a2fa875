#!/usr/bin/env bash
# Issue 23, part 3 (the 24 GiB mode), on the device in ONE call (the device tool: carry .whl), in at most 600 s:
#
#     run(command="bash bench/device/run_24gib.sh 585", carry=[".whl"], timeout_s=600)
#
# 1. A refusal before anything is built (exit 2, one line): a 12 GiB cap.
# 2. The service as on a 24 GiB card: 1.3B random bf16, 832x480, standard window (3 + 15), Wan VAE, and a UMT5-XXL
#    text encoder of Wan's geometry with random weights (--random-text-encoder umt5-xxl), which the cap puts on the
#    CPU (its prompts encoded off the device thread, each embedding cached), and the history gathered in every
#    forward (no 5.6 GiB gathered-context buffer, no DiT graphs: gather_history_once resolves off). Cases: the first session after
#    /readyz (pacing off, a new prompt: the CPU encode is in its time to first media), one paced viewer (the same
#    prompt: a cache hit; 0 deadline misses expected), two paced viewers (the second refused: the cap holds one).
#    /metrics' allocator peak against its cap, nvidia-smi's whole-card memory during each case (<= 24 GiB: the
#    CUDA context included), the log's measured activation peak and each prompt encode's time.
# 3. The same with --fp8 attention (it needs the gathered context and adds its 2.8 GiB e4m3 mirror: expected to
#    be refused after the warm-up) with what time is left.
# Files in $OUT: refuse_*.std*, service_gib24*.json, gib24*.json (summaries), logs.tar.gz.
set -u -o pipefail
# shellcheck source=bench/device/common.sh
. bench/device/common.sh
start_run "${1:-585}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
lscpu | grep -E "^(Model name|CPU\(s\)|Flags)" | cut -c1-200
SERVER=(--preset wan2.1-1.3b --device cuda --dtype bfloat16 --random-weights --random-text-encoder umt5-xxl)

part refuse_12gib 60 python3 -m app.cli serve "${SERVER[@]}" --gpu-memory-gib 12 --port 0
for name in refuse_12gib; do echo "$name: $(tail -n 1 "$OUT/$name.stderr")"; done
CASES=(--concurrency 1,2 --pacing on --duration 10 --first-duration 8 --no-transitions)
service gib24 "${GIB24_S:-300}" "${CASES[@]}" -- "${SERVER[@]}" --gpu-memory-gib 24
python3 bench/memory_mode_summary.py 24 "$OUT/service_gib24.json" "$OUT/logs/server_gib24.log" | tee "$OUT/gib24.json"
if [ "$(left)" -gt 200 ]; then
  ARSTREAM_ENGINE__FP8=attention service gib24_fp8 "$(( $(left) - 20 ))" --concurrency 1 --pacing on --duration 8 \
    --first-duration 6 --no-transitions -- "${SERVER[@]}" --gpu-memory-gib 24
  python3 bench/memory_mode_summary.py 24 "$OUT/service_gib24_fp8.json" "$OUT/logs/server_gib24_fp8.log" \
    | tee "$OUT/gib24_fp8.json"
fi
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
echo "== done, $(left)s left"
