#!/usr/bin/env bash
# Issue 31: the engine's FP8 attention with the last wave's query blocks split (tail_split), on the device in ONE
# call:
#
#     run(command="SERVE='fast:on standard:on fast:off' bash bench/device/run_fp8_attention_tail.sh 585",
#         carry=[".site.tar.xz"], timeout_s=600)
#
# 1. bench/fp8_attention_tail_gpu.py: the default config whole and split at the engine's two key counts, and the
#    wave probe; $OUT/tail.json. The verdict ($OUT/tail_verdict.txt): "split" when the split ran without NaN,
#    within 2 % of the whole kernel's output and faster at both key counts; else "whole".
# 2. GPU_TESTS=1: the FP8 attention GPU tests with the split on.
# 3. SERVE: services, each "what:on|off" (on: the split turned on in THIS COPY of the tree, the device's, by
#    setting _TAIL_SPLIT in engine/models/fp8_attention.py; "on" entries run only with a "split" verdict): fast =
#    the fast config's paced viewers (VIEWERS, default 3); standard = the standard window, pacing off;
#    standard_e4m3 = the same with e4m3 decode convolutions. All `--fp8 all`, fresh `arstream serve` each, the
#    first session after /readyz included. Files: service_*.json, logs/.
set -u -o pipefail
# shellcheck source=bench/device/common.sh
. bench/device/common.sh
start_run "${1:-585}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
part tail_bench "${BENCH_S:-120}" python3 bench/fp8_attention_tail_gpu.py
cp "$OUT/tail_bench.stdout" "$OUT/tail.json"
tail -n 12 "$OUT/tail_bench.stderr"
python3 - "$OUT/tail.json" > "$OUT/tail_verdict.txt" <<'PY' || echo whole > "$OUT/tail_verdict.txt"
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
print("wave probe ms", r["wave_probe_ms"], file=sys.stderr)
ok = all(per["split"].get("nan_count") == 0 and per.get("rel_split_vs_whole", 1) < 0.02
         and per["split"]["ms"] < per["whole"]["ms"] for per in r["per_sk"].values())
for sk, per in r["per_sk"].items():
    print(sk, {name: per[name].get("ms") for name in ("whole", "split")}, per.get("rel_split_vs_whole"),
          file=sys.stderr)
print("split" if ok else "whole")
PY
echo "verdict: $(cat "$OUT/tail_verdict.txt")"
set_tail() { sed -i "s/^_TAIL_SPLIT = .*/_TAIL_SPLIT = $1/" engine/models/fp8_attention.py; grep -n "^_TAIL_SPLIT" engine/models/fp8_attention.py; }
if [ "${GPU_TESTS:-0}" = 1 ] && [ "$(cat "$OUT/tail_verdict.txt")" = split ]; then
  set_tail True
  gpu_tests "${GPU_TESTS_S:-150}" tests/test_fp8_attention.py tests/test_fp8_attention_engine.py
fi
for entry in ${SERVE:-}; do
  what=${entry%%:*} mode=${entry##*:}
  if [ "$mode" = on ] && [ "$(cat "$OUT/tail_verdict.txt")" != split ]; then echo "$entry skipped (verdict)"; continue; fi
  if [ "$mode" = on ]; then set_tail True; else set_tail False; fi
  fp8_service "$what" "${what}_tail_$mode"
done
echo "== done, $(left)s left"
