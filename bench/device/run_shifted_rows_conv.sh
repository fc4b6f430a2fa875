#!/usr/bin/env bash
# Issue 31: the Wan decoder's convolutions through the shifted-rows Triton kernel, on the device in ONE call:
#
#     run(command="bash bench/device/run_shifted_rows_conv.sh 560", carry=[".site.tar.xz"], timeout_s=600)
#
# 1. bench/shifted_rows_conv_gpu.py: each decoder convolution shape, cuDNN vs the kernel's sweep; one session's
#    compiled decode with diffusers' convolutions, with the kernel and with it in e4m3 (ms a block, pixel
#    difference, graph breaks; the eager reference beside the compiled one as the rounding floor).
# 2. If the compiled decode got >= 5 % faster (or SERVICES names them): fresh `arstream serve` processes, standard window, `--fp8 all`,
#    1.3B random bf16 at 832x480, the first session after /readyz pacing off, `decode_convs` cudnn, triton,
#    triton_fp8 (SERVICES: DECODE_CONVS or DECODE_CONVS:FP8 each, FP8 default all), each while time is left. CONV_ARGS=--skip-shapes: the decode alone (MEASURED_CONFIGS).
# 3. The GPU tests of tests/test_shifted_rows_conv.py, while time is left.
# Files in $OUT: conv.json, shifted_rows_conv.std*, service_*.json, logs/, gpu_tests.txt.
set -u -o pipefail
# shellcheck source=bench/device/common.sh
. bench/device/common.sh
start_run "${1:-560}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
part shifted_rows_conv "${CONV_S:-300}" python3 bench/shifted_rows_conv_gpu.py ${CONV_ARGS:-} --out "$OUT/conv.json" --reps 10 \
  --blocks 4 --warmup 2
tail -n 12 "$OUT/shifted_rows_conv.stderr"
python3 - "$OUT/conv.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
for s in r["shapes"]:
    print(s.get("c_in"), s.get("c_out"), s.get("kernel"), s.get("frames"), s.get("height"), s.get("cudnn_ncdhw"),
          s.get("cudnn_channels_last"), {k: s.get("best", {}).get(k) for k in ("block_m", "block_n", "block_k", "num_warps", "num_stages", "ms", "tflops", "max_abs_diff_rel")})
print("latent frame conv ms", r.get("latent_frame_conv_ms"))
for d in r.get("decode", []):
    print(json.dumps({k: v for k, v in d.items()})[:600])
PY
read -r GAIN ORDER < <(python3 -c "
import json,sys
try:
    d=[x for x in json.load(open('$OUT/conv.json'))['decode'] if x.get('compiled')][0]
    fp8_first = d['kernel_fp8']['speedup'] > d['kernel']['speedup']
    print(int(max(d['kernel']['speedup'], d['kernel_fp8']['speedup']) >= 1.05),
          'cudnn triton_fp8 triton' if fp8_first else 'cudnn triton triton_fp8')
except Exception: print(0, 'cudnn')")
SERVER=(--preset wan2.1-1.3b --device cuda --dtype bfloat16 --random-weights)
CASES=(--concurrency 1 --pacing off --duration 12 --first-duration 12 --no-transitions)
for entry in ${SERVICES:-$ORDER}; do  # DECODE_CONVS or DECODE_CONVS:FP8 (default all)
  convs=${entry%%:*}; fp8=all; [ "$entry" != "$convs" ] && fp8=${entry#*:}
  if { [ "$GAIN" = 1 ] || [ -n "${SERVICES:-}" ]; } && [ "$(left)" -gt $(( ${SERVICE_S:-95} + 15 )) ]; then
    ARSTREAM_ENGINE__FP8=$fp8 ARSTREAM_ENGINE__DECODE_CONVS=$convs service "standard_${convs}_fp8_$fp8" "${SERVICE_S:-95}" \
      "${CASES[@]}" -- "${SERVER[@]}"
  else
    echo "service $entry skipped (gain $GAIN, $(left)s left)"
  fi
done
# shellcheck disable=SC2086
if [ "$(left)" -gt 45 ]; then gpu_tests "$(( $(left) - 10 ))" ${GPU_TESTS:-tests/test_shifted_rows_conv.py}; fi
echo "== done, $(left)s left"
