#!/usr/bin/env bash
# Ninth session, first device call (issues 23 and 22), in at most 600 s:
#
#     run(command="bash bench/device/run_probe_session9.sh 585", carry=[".whl"], timeout_s=600)
#
# 1. bench/memory_peak.py: where the probe block's memory goes (the 24 GiB mode's refusal), capture vs replay.
# 2. bench/vae_decode_stages.py --variants: the Wan decode per stage, and conv3d / conv2d x eager / compiled.
# 3. bench/device/run_input_bench.sh with what is left: the live input's drop count after its counting fix.
set -u -o pipefail
# shellcheck source=bench/device/common.sh
. bench/device/common.sh
start_run "${1:-585}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
part memory_peak 170 python3 bench/memory_peak.py --device cuda --dtype bfloat16
cat "$OUT/memory_peak.stdout"; tail -n 3 "$OUT/memory_peak.stderr"
part decode_variants 260 python3 bench/vae_decode_stages.py --device cuda --dtype bfloat16 --blocks 5 --variants
cat "$OUT/decode_variants.stdout"; tail -n 3 "$OUT/decode_variants.stderr"
if [ "$(left)" -gt 150 ]; then
  mkdir -p "$OUT/input"
  OUT="$OUT/input" BENCH_ARGS="--duration 8 --sessions 2" bash bench/device/run_input_bench.sh "$(( $(left) - 10 ))"
fi
echo "== done, $(left)s left"
