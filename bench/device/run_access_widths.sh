#!/usr/bin/env bash
# Issue 31: four kernels found slow from the CPU (thirty-seventh session), before and after on one machine:
# - decoders/conv_input_fp8.py, the e4m3 decode's residual-block inputs: loads one bf16 an instruction (strides
#   unspecialised), and bound by instruction issue (integer division per position, idle lanes, padding and cached
#   frames through the norm); now 16-byte accesses, a grid of lines, channels a power-of-two group at a time;
# - engine/models/qk_quantize.py and engine/models/history_fp8.py: one pair of channels an instruction; now
#   [rows, head_dim] tiles in 16-byte accesses;
# - engine/models/gelu_quantize.py, bound by issue with 45 % idle lanes (8,960 in a 16,384-wide block); now a
#   row in up to three power-of-two parts.
# BEFORE (default .baseline) holds those files as they were, made here (not on the device) and carried:
#
#     mkdir -p .baseline && for f in decoders/conv_input_fp8.py engine/models/qk_quantize.py \
#         engine/models/history_fp8.py engine/models/gelu_quantize.py; do git show 14c534a:$f > .baseline/${f//\//__}; done
#     run(command="SWEEP=0 bash bench/device/run_access_widths.sh 590", carry=[".site.tar.xz", ".baseline"])
#     run(command="BENCHES=0 GPU_TESTS=0 SERVE='standard_e4m3:after standard_e4m3:before fast:after' \
#         bash bench/device/run_access_widths.sh 590", carry=[".site.tar.xz", ".baseline"])
#
# 1. GPU_TESTS=1 (default): the GPU tests of the four kernels (the inputs' include the compiled decode on them)
#    and the FP8 engine (CUDA graphs).
# 2. BENCHES=1 (default): each bench with the tree's files ("after") and with BEFORE's swapped into THIS COPY
#    ("before"): bench/qk_quantize_gpu.py (qk_*.json), bench/history_fp8_gpu.py (the direct load against the
#    gather, history_*.json), bench/conv_input_fp8_gpu.py --default-only (input_*.json),
#    bench/gelu_quantize_gpu.py (gelu_*.json) (KERNEL_BENCHES: which of "qk history input gelu"); then SWEEP=1 (default) the input kernel's launches
#    (input_sweep.json) and DECODE=1 (default) the compiled e4m3 decode on the fused inputs, both ways
#    (conv_*.json).
#    WHICH (default "after before"): which trees the kernel benches run on.
# 3. SERVE: services "what:after|before|direct" (after and before with history_fp8.DIRECT_LOAD off, as main had
#    it until the thirty-eighth session; direct: after, with it on in THIS COPY),
#    `--fp8 all`, a fresh `arstream serve` each (bench/device/common.sh fp8_service). Files: service_*.json, logs/.
#    DIRECT_IF_FASTER=1: a direct entry runs only if the history bench (this run's) found the direct load faster.
set -u -o pipefail
# shellcheck source=bench/device/common.sh
. bench/device/common.sh
start_run "${1:-590}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
BEFORE=${BEFORE:-.baseline}
FILES="decoders/conv_input_fp8.py engine/models/qk_quantize.py engine/models/history_fp8.py engine/models/gelu_quantize.py"
mkdir -p /tmp/after
for f in $FILES; do cp "$f" "/tmp/after/${f//\//__}"; done
use() {  # use after|before: the three files from the tree or from BEFORE, in THIS COPY
  local from=/tmp/after
  [ "$1" = before ] && from=$BEFORE
  for f in $FILES; do cp "$from/${f//\//__}" "$f" || { echo "no $from/${f//\//__}"; return 1; }; done
  sed -i "s/^DIRECT_LOAD = .*/DIRECT_LOAD = ${2:-False}/" engine/models/history_fp8.py
}
if [ "${GPU_TESTS:-1}" = 1 ]; then
  gpu_tests "${GPU_TESTS_S:-170}" tests/test_conv_input_fp8.py tests/test_qk_quantize.py tests/test_history_fp8.py \
    tests/test_gelu_quantize.py tests/test_fp8_attention_engine.py
  grep -E "passed|failed|Error|assert" "$OUT/gpu_tests.txt" | tail -n 12
fi
if [ "${BENCHES:-1}" = 1 ]; then
  for which in ${WHICH:-after before}; do
    use "$which" || continue
    for bench in ${KERNEL_BENCHES-qk history input gelu}; do
      case $bench in
        qk) part "qk_$which" "${QK_S:-40}" python3 bench/qk_quantize_gpu.py ;;
        history) part "history_$which" "${HISTORY_S:-70}" python3 bench/history_fp8_gpu.py ;;
        input) part "input_$which" "${INPUT_S:-60}" python3 bench/conv_input_fp8_gpu.py --default-only ;;
        gelu) part "gelu_$which" "${GELU_S:-40}" python3 bench/gelu_quantize_gpu.py ;;
      esac
      tail -n 1 "$OUT/${bench}_$which.stdout" > "$OUT/${bench}_$which.json"; tail -n 3 "$OUT/${bench}_$which.stderr"
      cut -c1-600 "$OUT/${bench}_$which.json"
    done
  done
  use after
  if [ "${SWEEP:-1}" = 1 ]; then
    part input_sweep "${SWEEP_S:-150}" python3 bench/conv_input_fp8_gpu.py
    tail -n 1 "$OUT/input_sweep.stdout" > "$OUT/input_sweep.json"; tail -n 6 "$OUT/input_sweep.stderr"
  fi
  if [ "${DECODE:-1}" = 1 ]; then
    for which in after before; do
      use "$which" || continue
      part "decode_$which" "${DECODE_S:-100}" python3 bench/shifted_rows_conv_gpu.py --skip-shapes \
        --paths kernel_fp8_fused --profile kernel_fp8_fused --out "$OUT/conv_$which.json" --reps 10 --blocks 4 \
        --warmup 2
      tail -n 2 "$OUT/decode_$which.stderr"
      decode_summary "$OUT/conv_$which.json" 8
    done
  fi
fi
direct_faster() {  # the history bench's fast window: the direct load beat the gather (no bench: assume so)
  [ -f "$OUT/history_after.json" ] || return 0
  python3 -c 'import json,sys; w=json.load(open(sys.argv[1]))["windows"]["fast"]; sys.exit(w["direct_ms"] >= w["gather_ms"])' \
    "$OUT/history_after.json"
}
for entry in ${SERVE:-}; do
  what=${entry%%:*} mode=${entry##*:}
  if [ "$mode" = direct ] && [ "${DIRECT_IF_FASTER:-0}" = 1 ] && ! direct_faster; then
    echo "$entry skipped: the direct load was not faster"; continue
  fi
  case $mode in
    before) use before ;; direct) use after True ;; *) use after ;;
  esac
  fp8_service "$what" "${what}_$mode"
done
use after
echo "== done, $(left)s left"
