#!/usr/bin/env bash
# Issue 31, before building the overlap: bench/overlap_probe.py on the GPU for the standard config in bf16 and
# with FP8 attention (one JSON line each in $OUT), in one device call (carry .site.tar.xz or .whl):
#
#     bash bench/device/run_overlap_probe.sh [TOTAL_S=300]
set -u -o pipefail
# shellcheck source=bench/device/common.sh
. bench/device/common.sh
start_run "${1:-300}"
for precision in bf16 fp8; do
  extra=$([ "$precision" = fp8 ] && echo "--fp8 attention")
  # shellcheck disable=SC2086  # the option's words
  part "overlap_$precision" "$(( $(left) / 2 > 170 ? 170 : $(left) / 2 ))" python3 bench/overlap_probe.py \
    --device cuda --dtype bfloat16 --preset wan2.1-1.3b $extra
  tail -n 1 "$OUT/overlap_$precision.stdout"; tail -n 3 "$OUT/overlap_$precision.stderr"
done
