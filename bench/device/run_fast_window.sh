#!/usr/bin/env bash
# Issue 31, part 2 (thirty-eighth session): the fast window's block (~236 ms of DiT on an H100; three paced
# viewers need ~227 with realtime admission's margin), in ONE device call:
#
#     run(command="bash bench/device/run_fast_window.sh 590", carry=[".site.tar.xz"], timeout_s=600)
#
# 1. bench/fp8_fast_accum_gpu.py: the 1.3B's eight FP8 products with fast accumulation off / on (ms, error), and
#    the GPU tests of tests/test_fp8_linear.py (the fast product's bound among them).
# 2. bench/fp8_linear_probe.py, CUDA graphs on, window 6: the DiT block with `--fp8 all`, fast accumulation off
#    and on (MODES, default "all/exact,all/fast"), one process.
# 3. bench/history_fp8_gpu.py: the history's direct load against the gather.
# 4. The fast service (three paced viewers, a fresh server) with the tree's defaults: fast accumulation and the
#    history's direct load, both on since this session measured them (in its call the script switched the direct
#    load on where (3) found it faster). SERVE_FAST=0 skips it.
# 5. BATCHES (e.g. 1,2,3), if time is left: bench/batch_probe.py.
# Files in $OUT: fast_accum.json, gpu_tests.txt, probe.json, history.json, service_*.json, batch_probe.json, logs/.
set -u -o pipefail
# shellcheck source=bench/device/common.sh
. bench/device/common.sh
start_run "${1:-590}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
part fast_accum 60 python3 bench/fp8_fast_accum_gpu.py
last_line fast_accum
gpu_tests 90 tests/test_fp8_linear.py
part probe "${PROBE_S:-150}" python3 bench/fp8_linear_probe.py --device cuda --dtype bfloat16 --preset wan2.1-1.3b \
  --modes "${MODES:-all/exact,all/fast}" --window-frames 6 --cuda-graphs --top 12
last_line probe 4000
part history 70 python3 bench/history_fp8_gpu.py
last_line history
if [ "${SERVE_FAST:-1}" = 1 ]; then
  fp8_service fast fast_defaults
fi
if [ -n "${BATCHES:-}" ] && [ "$(left)" -gt 100 ]; then
  part batch_probe "$(( $(left) - 10 ))" python3 bench/batch_probe.py --device cuda --dtype bfloat16 \
    --preset wan2.1-1.3b --batches "$BATCHES"
  last_line batch_probe 3000
fi
echo "== done, $(left)s left"
