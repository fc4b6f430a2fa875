#!/usr/bin/env bash
# One device call of the engine-level checks of the fifth session (the device tool: carry .whl):
#
#     bash bench/device/run_engine_checks.sh
#
# GPU tests of the fast paths and FP8; how torch's affine norm rounds (bench/affine_norm_gpu.py); the FP8
# kernel's configs (exp_f16 too, until it was removed) and the quantizer's casts (bench/fp8_attention_gpu.py); the DiT
# at the fast window, bf16 (equivalence, forward, profile) and FP8 attention (forward, profile).
# The JSON lines come back as files; the traces, profiles and logs in one tarball (the tool returns 8 files).
set -u -o pipefail
WORK=/tmp/engine-checks
mkdir -p "$WORK"
# shellcheck source=bench/device/common.sh
. bench/device/common.sh
install_wheels
PART_DIR=$WORK
part gpu_tests "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fast_paths.py \
  tests/test_fp8_attention.py tests/test_fp8_attention_engine.py
tail -n 3 "$WORK/gpu_tests.stdout"
part affine_norm 60 python3 bench/affine_norm_gpu.py
cat "$WORK/affine_norm.stdout"
part sweep "${SWEEP_S:-150}" python3 bench/fp8_attention_gpu.py --engine-sweep 4680,9360,14040,18720,28080,32760 \
  --out "$WORK/sweep.jsonl"
part quantize 60 python3 bench/fp8_attention_gpu.py --quantize-sweep 4680,9360,14040,18720,28080,32760 \
  --out "$WORK/quant.jsonl"
part bf16 "${BF16_S:-200}" python3 bench/bench_fast_paths.py --window-frames 6 --sections equivalence,forward,profile \
  --blocks 6 --variants engine --no-compile-decoder --out "$WORK/bf16.jsonl"
part fp8 "${FP8_S:-120}" python3 bench/bench_fast_paths.py --window-frames 6 --fp8 attention --sections forward,profile \
  --blocks 6 --variants engine --no-compile-decoder --out "$WORK/fp8.jsonl"
OUT=${OUT:-$PWD/out-device}
mkdir -p "$OUT"
for f in sweep quant bf16 fp8; do [ -f "$WORK/$f.jsonl" ] && cp "$WORK/$f.jsonl" "$OUT/"; done
cp "$WORK/affine_norm.stdout" "$OUT/affine_norm.json" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$WORK" --exclude='*.jsonl' .
echo "== done at $SECONDS s"
