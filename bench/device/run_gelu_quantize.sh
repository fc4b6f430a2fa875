#!/usr/bin/env bash
# Issue 31: the FFN's GELU quantizer, compiled (Inductor, what --fp8 linear runs) against the one-pass Triton
# kernel (engine/models/gelu_quantize.py), and their GPU tests, in one device call:
#
#     run(command="bash bench/device/run_gelu_quantize.sh 200", carry=[".site.tar.xz"], timeout_s=230)
#
# Files in $OUT: gelu_quantize.std*, gpu_tests.txt.
set -u -o pipefail
# shellcheck source=bench/device/common.sh
. bench/device/common.sh
start_run "${1:-200}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
part gelu_quantize "${GELU_S:-90}" python3 bench/gelu_quantize_gpu.py
tail -n 1 "$OUT/gelu_quantize.stdout"; tail -n 3 "$OUT/gelu_quantize.stderr"
if [ "$(left)" -gt 40 ]; then gpu_tests "$(( $(left) - 10 ))" tests/test_gelu_quantize.py tests/test_fp8_linear.py; fi
echo "== done, $(left)s left"
