#!/usr/bin/env bash
# Issue 23, part 2, first step, on the device in ONE call (the device tool: carry .whl), in at most 600 s:
#
#     run(command="bash bench/device/run_decode_profile.sh 400", carry=[".whl"], timeout_s=420)
#
# Where the standard window's Wan VAE decode spends its ~175 ms a block at 832x480: bench/vae_decode_stages.py
# in bf16, eager (per stage: ms, GFLOP, achieved TFLOP/s), then again with the engine's compiled steady state timed too.
# Files in $OUT: decode_stages_{eager,compiled}.std{out,err}.
set -u -o pipefail
# shellcheck source=bench/device/common.sh
. bench/device/common.sh
start_run "${1:-400}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
part decode_stages_eager 180 python3 bench/vae_decode_stages.py --device cuda --dtype bfloat16 --blocks 5
cat "$OUT/decode_stages_eager.stdout"; tail -n 3 "$OUT/decode_stages_eager.stderr"
part decode_stages_compiled "$(( $(left) - 10 ))" python3 bench/vae_decode_stages.py --device cuda --dtype bfloat16 \
  --blocks 5 --compile
cat "$OUT/decode_stages_compiled.stdout"; tail -n 3 "$OUT/decode_stages_compiled.stderr"
echo "== done, $(left)s left"
