#!/usr/bin/env bash
# Issue 31, part 2: where the fast window's block goes (window 6, `--fp8 all`; the DiT only: TAEHV's decode is
# ~3 ms), bench/fp8_linear_probe.py twice: CUDA graphs off (every kernel profiled and summed by kind) and on (the
# engine's own block time). Their difference is what runs between the kernels. GRAPHS picks them (default "off
# on"); BATCHES (e.g. 1,3) then runs bench/batch_probe.py (sessions batched into one forward). JSON lines in $OUT:
#
#     run(command="bash bench/device/run_fast_probe.sh 200", carry=[".site.tar.xz"])   # GRAPHS="off on" (default)
set -u -o pipefail
# shellcheck source=bench/device/common.sh
. bench/device/common.sh
start_run "${1:-200}"
for graphs in ${GRAPHS:-off on}; do
  flag=()
  [ "$graphs" = on ] && flag=(--cuda-graphs)
  part "fast_probe_graphs_$graphs" "${PROBE_S:-110}" python3 bench/fp8_linear_probe.py --device cuda \
    --dtype bfloat16 --preset wan2.1-1.3b --modes "${MODES:-all}" --window-frames "${WINDOW:-6}" --top 25 "${flag[@]}"
  last_line "fast_probe_graphs_$graphs" 3000
done
if [ -n "${BATCHES:-}" ]; then  # bench/batch_probe.py: B sessions' blocks in one forward, per session
  part batch_probe "${BATCH_S:-120}" python3 bench/batch_probe.py --device cuda --dtype bfloat16 \
    --preset wan2.1-1.3b --batches "$BATCHES"
  last_line batch_probe 3000
fi
echo "== done, $(left)s left"
