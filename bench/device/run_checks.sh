#!/usr/bin/env bash
# One device call of checks and engine-level benchmarks (the device tool: carry .whl):
#
#     bash bench/device/run_checks.sh
#
# 1. the GPU-marked tests of the fast paths and FP8 (graphs, compiled kernels, _scaled_mm, captures);
# 2. the FP8 attention kernel against cuDNN (bench/fp8_attention_gpu.py);
# 3. FP8 linears (QUALITY_VARIANTS=linear,attention,all: and FP8 attention) against bf16 on the same weights
#    and noise (bench/fp8_quality.py);
# 4. the DiT fast paths: equivalence and its ablation, forward timings, a profile (bench/bench_fast_paths.py).
# Each part has its own time limit; everything lands in $OUT.
set -u -o pipefail
OUT=${OUT:-$PWD/out-device}
mkdir -p "$OUT"
# shellcheck source=bench/device/common.sh
. bench/device/common.sh
install_wheels
part gpu_tests "${TESTS_S:-120}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fast_paths.py \
  tests/test_fp8_linear.py tests/test_fp8_attention.py tests/test_fp8_attention_engine.py
tail -n 3 "$OUT/gpu_tests.stdout"
part fp8_attention "${ATTN_S:-150}" python3 bench/fp8_attention_gpu.py --out "$OUT/fp8attn.jsonl"
tail -n 1 "$OUT/fp8_attention.stdout" | cut -c1-1500
part fp8_quality "${QUALITY_S:-150}" python3 bench/fp8_quality.py --preset wan2.1-1.3b --device cuda --dtype bfloat16 \
  --random-weights --blocks "${QUALITY_BLOCKS:-12}" --variants "${QUALITY_VARIANTS:-linear}" --out "$OUT/fp8_quality.jsonl"
tail -n 1 "$OUT/fp8_quality.stdout" | cut -c1-1500
part fast_paths "${FAST_S:-300}" python3 bench/bench_fast_paths.py ${FAST_ARGS:---sections equivalence,ablation,forward,profile \
  --blocks 6 --variants engine,normsfused} --out "$OUT/fast.jsonl"
grep -v '"bench"\|"section": "forward",' "$OUT/fast.jsonl" | cut -c1-900
echo "== done at $SECONDS s"
