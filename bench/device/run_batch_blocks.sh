#!/usr/bin/env bash
# Issue 31, the fast window's third viewer (thirty-ninth session): sessions batched into one forward, in ONE
# device call:
#
#     run(command="SESSIONS2=2 SERVE_FAST=1 bash bench/device/run_batch_blocks.sh 560", carry=[".site.tar.xz"],
#         timeout_s=600)
#
# 1. The GPU tests of the batched path and of what it changed (the FP8 mirror's slots, the history's load into a
#    slot, the graphs' keys): tests/test_batched_blocks.py, tests/test_fp8_attention_engine.py,
#    tests/test_history_fp8.py, tests/test_qk_quantize.py, tests/test_fast_paths.py, tests/test_stop_for_restart.py.
# 2. bench/batch_blocks.py at the fast window (1.3B random bf16, `--fp8 all`, CUDA graphs): SESSIONS (default 3)
#    sessions one at a time against one batch, ms per session and block, each session's latents compared.
# 3. SESSIONS2 (e.g. 2), if time is left: the same for that many sessions.
# 4. SERVE_FAST=1, if time is left: the fast service (three paced viewers, a fresh server, the first session after
#    /readyz included) with ARSTREAM_ENGINE__BATCH_SESSIONS=${BATCH:-3}; BASELINE=1 first serves it unbatched (the
#    same machine's before).
# Files in $OUT: gpu_tests.txt, batch_blocks*.json, service_*.json, logs/.
set -u -o pipefail
# shellcheck source=bench/device/common.sh
. bench/device/common.sh
start_run "${1:-560}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
gpu_tests "${TESTS_S:-180}" tests/test_batched_blocks.py tests/test_fp8_attention_engine.py tests/test_history_fp8.py \
  tests/test_qk_quantize.py tests/test_fast_paths.py tests/test_stop_for_restart.py
tail -n 15 "$OUT/gpu_tests.txt" | grep -E "passed|failed|Error|assert" | head -8
fast=(--device cuda --dtype bfloat16 --preset wan2.1-1.3b --fp8 all --window-frames 6 --cuda-graphs)
part batch_blocks "${BATCH_S:-200}" python3 bench/batch_blocks.py "${fast[@]}" --sessions "${SESSIONS:-3}"
last_line batch_blocks 3000
if [ -n "${SESSIONS2:-}" ] && [ "$(left)" -gt 150 ]; then
  part batch_blocks_2 150 python3 bench/batch_blocks.py "${fast[@]}" --sessions "$SESSIONS2"
  last_line batch_blocks_2 3000
fi
if [ "${BASELINE:-0}" = 1 ]; then
  fp8_service fast fast_unbatched
fi
if [ "${SERVE_FAST:-0}" = 1 ]; then
  ARSTREAM_ENGINE__BATCH_SESSIONS=${BATCH:-3} NAME_SUFFIX=_${BATCH:-3} fp8_service fast fast_batched
fi
echo "== done, $(left)s left"
