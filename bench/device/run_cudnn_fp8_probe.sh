#!/usr/bin/env bash
# Issue 31: cuDNN's FP8 attention against ours and bf16 at the engine's shapes (bench/cudnn_fp8_attention_probe.py),
# one JSON line in $OUT, in one device call. Needs only torch (the device's) and the cuDNN frontend's wheel, kept
# apart from .whl/ (pack_site.sh packs every wheel there into the service's site):
#
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl-cudnn nvidia-cudnn-frontend==1.16.0
#     run(command="bash bench/device/run_cudnn_fp8_probe.sh", carry=[".whl-cudnn"])
set -u -o pipefail
OUT=${OUT:-$PWD/out-device}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/cudnnfe .whl-cudnn/nvidia_cudnn_frontend-*.whl \
  || { echo "cudnn frontend install failed"; exit 1; }
# The frontend dlopens libcudnn: point it at the one torch loads.
cudnn_dir=$(python3 - <<'PY'
import glob, os, torch
roots = {os.path.dirname(os.path.dirname(torch.__file__))}
found = [p for r in roots for p in glob.glob(os.path.join(r, "nvidia", "**", "libcudnn.so.9"), recursive=True)]
print(os.path.dirname(found[0]) if found else "")
PY
)
echo "libcudnn in: ${cudnn_dir:-not found}"
export LD_LIBRARY_PATH=${cudnn_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONPATH=/tmp/cudnnfe:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout -k 5 "${LIMIT_S:-240}" python3 bench/cudnn_fp8_attention_probe.py --keys "${KEYS:-18720,32760}" \
  > "$OUT/cudnn_fp8_probe.jsonl" 2> "$OUT/cudnn_fp8_probe.stderr"
echo "probe exit $?"
cat "$OUT/cudnn_fp8_probe.jsonl"; tail -n 40 "$OUT/cudnn_fp8_probe.stderr"
