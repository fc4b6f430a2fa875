#!/usr/bin/env bash
# Issue 31: the FP8 modes' layer norms writing their products' e4m3 rows (engine/models/norm_quantize.py), on the
# device in ONE call (or two: the parts are switched by the variables below):
#
#     run(command="bash bench/device/run_norm_quantize.sh 590", carry=[".site.tar.xz"], timeout_s=600)
#
# 1. GPU_TESTS=1 (default): the GPU tests of both kernels, the FP8 linears and the FP8 engine (CUDA graphs).
# 2. BENCH=1 (default): bench/norm_quantize_gpu.py, the three norms' chains apart against the kernel under each
#    launch configuration; norm.json. PICK=1 (default): its fastest configuration within the tests' bounds is
#    written into THIS COPY of the tree (engine/models/norm_quantize.py's DEFAULT_CONFIG) for what follows.
#    Then bench/qk_quantize_gpu.py (q / k in one pass against their four, the static scale's attention error);
#    qk.json.
# 2b. HISTORY_BENCH=1 (default): bench/history_fp8_gpu.py, the FP8 mirror's history load through the gather path
#    and straight from the pool, at both windows; history.json.
# 3. PROBE (default "all/apart,all"): bench/fp8_linear_probe.py's kernel sums of a standard block for those modes
#    (graphs off), the 40 largest kernels; probe.json.
# 4. DECODE_PROFILE=1 (default): bench/shifted_rows_conv_gpu.py's compiled decode with the kernel in bf16 and in
#    e4m3, each profiled by kernel (40 largest); conv.json.
# 5. SERVE: services, each "what:on|off|gather" (off: QUANTIZED_NORMS set False in THIS COPY of the tree, the
#    device's, in engine/models/kernels.py: the norms and q / k as before the thirty-fifth session; gather: those
#    on, but DIRECT_LOAD set False in engine/models/history_fp8.py: the mirror's history through the bf16 buffer;
#    off also sets DIRECT_LOAD False; on sets it True, which is not the default since the thirty-sixth session): fast = the fast config's paced viewers (VIEWERS, default 3); standard = the
#    standard window, pacing off; standard_e4m3 = the same with e4m3 decode convolutions. All `--fp8 all`, fresh
#    `arstream serve` each, the first session after /readyz included. Files: service_*.json, logs/.
set -u -o pipefail
# shellcheck source=bench/device/common.sh
. bench/device/common.sh
start_run "${1:-590}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if [ "${GPU_TESTS:-1}" = 1 ]; then
  gpu_tests "${GPU_TESTS_S:-150}" tests/test_norm_quantize.py tests/test_qk_quantize.py tests/test_fp8_linear.py \
    tests/test_fp8_attention_engine.py
fi
if [ "${BENCH:-1}" = 1 ]; then
  part norm_bench "${BENCH_S:-150}" python3 bench/norm_quantize_gpu.py
  tail -n 1 "$OUT/norm_bench.stdout" > "$OUT/norm.json"; tail -n 5 "$OUT/norm_bench.stderr"
  python3 - "$OUT/norm.json" > "$OUT/norm_pick.txt" <<'PY' || true
import json, re, sys
r = json.loads(open(sys.argv[1]).read())
for kind, entry in r["per_norm"].items():
    print(kind, {name: (round(e["ms"] * 1000, 1) if "ms" in e else e.get("error"), e.get("values_equal_fraction"))
                 for name, e in entry.items() if isinstance(e, dict)}, file=sys.stderr)
print("best", r.get("best_config"), r.get("best_config_ms"), "apart", r.get("apart_ms"),
      "predicted saving, ms a standard block:", r.get("predicted_saving_ms_per_standard_block"), file=sys.stderr)
m = re.fullmatch(r"rows(\d+)_warps(\d+)_(divide|multiply)", r.get("best_config") or "")
if m:
    print(f"NormQuantizeConfig({m[1]}, {m[2]}, divide={m[3] == 'divide'})")
PY
  if [ "${PICK:-1}" = 1 ] && [ -s "$OUT/norm_pick.txt" ]; then
    sed -i "s/^DEFAULT_CONFIG = NormQuantizeConfig(.*/DEFAULT_CONFIG = $(cat "$OUT/norm_pick.txt")/" engine/models/norm_quantize.py
  fi
  grep -n "^DEFAULT_CONFIG" engine/models/norm_quantize.py
  part qk_bench "${QK_S:-90}" python3 bench/qk_quantize_gpu.py
  tail -n 1 "$OUT/qk_bench.stdout" > "$OUT/qk.json"; tail -n 3 "$OUT/qk_bench.stderr"; cut -c1-900 "$OUT/qk.json"
fi
if [ "${HISTORY_BENCH:-1}" = 1 ]; then  # the mirror's history: gather path against the direct load
  part history_bench "${HISTORY_S:-120}" python3 bench/history_fp8_gpu.py
  tail -n 1 "$OUT/history_bench.stdout" > "$OUT/history.json"; tail -n 3 "$OUT/history_bench.stderr"
  cut -c1-600 "$OUT/history.json"
fi
if [ -n "${PROBE-all/apart,all}" ]; then  # "all/apart": QUANTIZED_NORMS and DIRECT_LOAD off, as before session 35
  part probe "${PROBE_S:-200}" python3 bench/fp8_linear_probe.py --device cuda --dtype bfloat16 \
    --preset wan2.1-1.3b --modes "${PROBE-all/apart,all}" --top 40
  tail -n 1 "$OUT/probe.stdout" > "$OUT/probe.json"; tail -n 3 "$OUT/probe.stderr"
  python3 - "$OUT/probe.json" <<'PY' || true
import json, sys
r = json.loads(open(sys.argv[1]).read())
for run in r["runs"]:
    print(run["mode"], run["block_ms_median"], run["kernel_ms_per_block_by_kind"], run["kernel_ms_per_block_total"])
PY
fi
if [ "${DECODE_PROFILE:-1}" = 1 ]; then
  part decode_profile "${DECODE_S:-170}" python3 bench/shifted_rows_conv_gpu.py --skip-shapes --profile kernel,kernel_fp8 \
    --out "$OUT/conv.json" --reps 10 --blocks 4 --warmup 2
  tail -n 4 "$OUT/decode_profile.stderr"
fi
set_norms() { sed -i "s/^QUANTIZED_NORMS = .*/QUANTIZED_NORMS = $1/" engine/models/kernels.py; grep -n "^QUANTIZED_NORMS" engine/models/kernels.py; }
set_direct() { sed -i "s/^DIRECT_LOAD = .*/DIRECT_LOAD = $1/" engine/models/history_fp8.py; grep -n "^DIRECT_LOAD" engine/models/history_fp8.py; }
for entry in ${SERVE:-}; do
  what=${entry%%:*} mode=${entry##*:}
  case $mode in
    on) set_norms True; set_direct True ;;
    gather) set_norms True; set_direct False ;;
    *) set_norms False; set_direct False ;;
  esac
  fp8_service "$what" "${what}_norms_$mode"
done
echo "== done, $(left)s left"
