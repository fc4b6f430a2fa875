#!/usr/bin/env bash
# Issue 31: the e4m3 decode's residual-block inputs in one pass (decoders/conv_input_fp8.py), with the thirty-fifth
# session's unmeasured history load (engine/models/history_fp8.py), on the device in one or two calls:
#
#     run(command="bash bench/device/run_conv_input.sh 590", carry=[".site.tar.xz"], timeout_s=600)
#
# 1. GPU_TESTS=1 (default): the GPU tests of the fused inputs, the shifted-rows convolution (its compiled decode)
#    and the FP8 engine (the mirror straight from the pool, under CUDA graphs).
# 2. HISTORY_BENCH=1 (default): bench/history_fp8_gpu.py, the mirror's history through the gather path and
#    straight from the pool; history.json.
# 2b. INPUT_BENCH=1 (default): bench/conv_input_fp8_gpu.py, the kernel under each launch (rows, warps) at the
#    decoder's shapes against the compiled path it replaced; input.json. Its best launch is not installed here:
#    set default_launch (VALUES_PER_THREAD, DEFAULT_WARPS) in decoders/conv_input_fp8.py from it, then run DECODE.
# 3. DECODE=1 (default): bench/shifted_rows_conv_gpu.py's compiled decode, the e4m3 path with the compiled inputs
#    and with the fused ones (PATHS), each profiled by kernel (40 largest); conv.json.
# 4. SERVE: services "what:on|off" (on: this tree; off: the fused inputs switched off in THIS COPY of the tree,
#    conv_input_fp8.FUSED), `--fp8 all`, fresh `arstream serve` each (bench/device/common.sh fp8_service).
#    Files: service_*.json, logs/.
set -u -o pipefail
# shellcheck source=bench/device/common.sh
. bench/device/common.sh
start_run "${1:-590}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if [ "${GPU_TESTS:-1}" = 1 ]; then
  gpu_tests "${GPU_TESTS_S:-170}" tests/test_conv_input_fp8.py tests/test_shifted_rows_conv.py \
    tests/test_fp8_attention_engine.py
  grep -E "passed|failed|Error|assert" "$OUT/gpu_tests.txt" | tail -n 12
fi
if [ "${HISTORY_BENCH:-1}" = 1 ]; then
  part history_bench "${HISTORY_S:-100}" python3 bench/history_fp8_gpu.py
  tail -n 1 "$OUT/history_bench.stdout" > "$OUT/history.json"; tail -n 3 "$OUT/history_bench.stderr"
  cut -c1-700 "$OUT/history.json"
fi
if [ "${INPUT_BENCH:-1}" = 1 ]; then  # the kernel's launches at the decoder's shapes against the compiled path
  part input_bench "${INPUT_S:-150}" python3 bench/conv_input_fp8_gpu.py
  tail -n 1 "$OUT/input_bench.stdout" > "$OUT/input.json"; tail -n 6 "$OUT/input_bench.stderr"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['ms_per_latent_frame'])" "$OUT/input.json" || true
fi
if [ "${DECODE:-1}" = 1 ]; then
  paths=${PATHS:-kernel_fp8,kernel_fp8_fused}
  part decode "${DECODE_S:-200}" python3 bench/shifted_rows_conv_gpu.py --skip-shapes --paths "$paths" \
    --profile "$paths" --out "$OUT/conv.json" --reps 10 --blocks 4 --warmup 2
  tail -n 3 "$OUT/decode.stderr"
  decode_summary "$OUT/conv.json"
fi
set_switches() {
  sed -i "s/^FUSED = .*/FUSED = $1/" decoders/conv_input_fp8.py
  grep -n "^FUSED" decoders/conv_input_fp8.py
}
for entry in ${SERVE:-}; do
  what=${entry%%:*} mode=${entry##*:}
  if [ "$mode" = on ]; then set_switches True; else set_switches False; fi
  fp8_service "$what" "${what}_$mode"
done
echo "== done, $(left)s left"
