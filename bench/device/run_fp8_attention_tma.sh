#!/usr/bin/env bash
# Issue 31: the FP8 attention's one-loop tensor-descriptor kernel (warp-specialised and not) beside the pointer
# kernel, and the Wan decode with the wide-chunk convolution configs, on the device in ONE call:
#
#     run(command="bash bench/device/run_fp8_attention_tma.sh 420", carry=[".site.tar.xz"], timeout_s=450)
#
# 1. bench/fp8_attention_gpu.py --engine-sweep --sweep tma: the engine's two-segment attention at KEYS (history
#    = keys - 4,680), every config of TMA_SWEEP: ms, TFLOP/s, error vs float32 and cuDNN, NaNs, wgmma / TMA /
#    warp specialisation in the PTX.
# 2. The GPU tests of tests/test_fp8_attention_engine.py (the kernels at the 1.3B head geometry, in a graph).
# 3. DECODE=1: bench/shifted_rows_conv_gpu.py --skip-shapes: one session's compiled decode with cuDNN, the bf16
#    kernel and e4m3 (MEASURED_CONFIGS).
# Files in $OUT: sweep.jsonl, fp8_attention_sweep.std*, gpu_tests.txt, conv.json, shifted_rows_conv.std*.
set -u -o pipefail
# shellcheck source=bench/device/common.sh
. bench/device/common.sh
start_run "${1:-420}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# The warp-specialised configs each in a process of their own under a timeout: one hung the first call's sweep.
SWEEP=(python3 bench/fp8_attention_gpu.py --engine-sweep "${KEYS:-18720,32760}" --sweep tma --out "$OUT/sweep.jsonl")
NAMES=$(python3 bench/fp8_attention_gpu.py --sweep tma --list-configs)
part fp8_attention_sweep "${SWEEP_S:-150}" "${SWEEP[@]}" --only "$(echo "$NAMES" | grep -v -- -ws | paste -sd,)"
for name in $(echo "$NAMES" | grep -- -ws); do
  part "fp8_attention_$name" "${WS_S:-40}" "${SWEEP[@]}" --only "$name"
done
python3 - "$OUT/sweep.jsonl" <<'PY' || true
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("engine_sweep_summary"):
        continue
    print("Sk", r["sk"], "cudnn", r.get("cudnn_ms"), "best", {k: (r.get("best") or {}).get(k) for k in
          ("block_m", "block_n", "num_warps", "num_stages", "tma", "warp_specialize", "ms", "tflops")})
    for c in r["configs"]:
        print("  ", {k: c.get(k) for k in ("block_m", "block_n", "num_warps", "num_stages", "tma", "warp_specialize",
                                            "device_descriptors", "ms", "tflops", "rel_err_fp32", "nan_count",
                                            "warp_specialized", "error")})
PY
if [ "$(left)" -gt 60 ]; then gpu_tests 60 tests/test_fp8_attention_engine.py -k "not tma_ws"; fi
if [ "${DECODE:-0}" = 1 ] && [ "$(left)" -gt 100 ]; then
  part shifted_rows_conv "$(( $(left) - 15 ))" python3 bench/shifted_rows_conv_gpu.py --skip-shapes --out "$OUT/conv.json" \
    --reps 10 --blocks 4 --warmup 2
  tail -n 8 "$OUT/shifted_rows_conv.stderr"
  python3 -c "
import json
for d in json.load(open('$OUT/conv.json')).get('decode', []):
    print(json.dumps(d)[:700])" || true
fi
echo "== done, $(left)s left"
