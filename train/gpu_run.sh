#!/usr/bin/env bash
# One device call of the tiny model's training (docs/TINY_MODEL.md): install the carried wheels, run
# train.run within TOTAL_S, pack the checkpoint. Everything that comes back lies in $OUT (at most 6 files).
#
#   run(command="bash train/gpu_run.sh 560 --init engine/models/weights/tiny --init-modules audio_vae",
#       carry=[".whl"], timeout_s=600)
#   # a later call resumes from the checkpoint the last one packed, unpacked into the ignored .train-ckpt/:
#   run(command="bash train/gpu_run.sh 560 --only dit", carry=[".whl", ".train-ckpt"], timeout_s=600)
#   # a continuation round of the clip-continuation stage alone, from the shipped weights (train.dit, stage D):
#   run(command="bash train/gpu_run.sh 330 --only dit --round 3 --init engine/models/weights/tiny "
#       "--budget tf_s=0,fewstep_s=0,rollout_s=0,cont_s=180,dit_lr=2e-4", carry=[".whl"], timeout_s=360)
set -u
TOTAL=$1
shift
OUT=${OUT:-$PWD/out-train}
mkdir -p "$OUT" .train-ckpt
source bench/device/common.sh
install_wheels
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== $SECONDS s: train.run $*"
# Stopped 30 s before TOTAL_S, so the checkpoint (saved every ~45 s and at each stage's end) is packed in time.
timeout -k 10 $((TOTAL - 30 - SECONDS)) python3 -m train.run --checkpoint .train-ckpt --log "$OUT/train.log" \
  --images "$OUT" "$@" > "$OUT/train.stdout" 2> "$OUT/train.stderr"
echo "train exit $? after $SECONDS s"
tar czf "$OUT/ckpt.tgz" .train-ckpt
# Loss lines (every stage, every round: tf, tf2, cont3, cont3r, ...) are in $OUT/train.log; the summary repeats the last.
grep -v -E "^(tf|fewstep|rollout|codec|cont)[0-9]*r? step" "$OUT/train.stdout" | tail -n 70
tail -n 5 "$OUT/train.stderr"
