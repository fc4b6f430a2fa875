#!/usr/bin/env bash
# Issue 31: where the standard block's GPU time goes with and without FP8 linears (bench/fp8_linear_probe.py),
# one JSON line in $OUT, in one device call (carry .site.tar.xz or .whl):
#
#     bash bench/device/run_fp8_linear_probe.sh [TOTAL_S=280]
set -u -o pipefail
# shellcheck source=bench/device/common.sh
. bench/device/common.sh
start_run "${1:-280}"
part fp8_linear_probe "$(( $(left) - 10 ))" python3 bench/fp8_linear_probe.py --device cuda --dtype bfloat16 \
  --preset wan2.1-1.3b --modes "${MODES:-none,linear,attention,all}"
tail -n 1 "$OUT/fp8_linear_probe.stdout"; tail -n 3 "$OUT/fp8_linear_probe.stderr"
