#!/usr/bin/env bash
# Several rounds of the tiny model's training side by side in one device call (the tiny DiT leaves the GPU mostly
# idle: each round is bound by its own host thread): install the carried site, run each `NAME|train.run args` within
# TOTAL_S, with half the host's cores apiece, and pack each round (its checkpoint, log, output and check images)
# into $OUT/NAME.tgz. One file a round comes back, whatever its images.
#
#   run(command="TOTAL=560 bash train/gpu_variants.sh 'a|--only dit --round 6 --init engine/models/weights/tiny "
#       "--budget ...' 'b|...'", carry=[".site.tar.xz"], timeout_s=600)
set -u
TOTAL=${TOTAL:-560}
OUT=${OUT:-$PWD/out-train}
mkdir -p "$OUT"
source bench/device/common.sh
install_wheels
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
threads=$(( $(nproc) / $# ))
names=()
for spec in "$@"; do
  name=${spec%%|*}
  args=${spec#*|}
  names+=("$name")
  dir=.train-$name
  mkdir -p "$dir/out"
  echo "== $SECONDS s: $name: train.run $args ($threads threads)"
  # Stopped 30 s before TOTAL, so each checkpoint (saved every ~45 s and at each stage's end) is packed in time.
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=$threads timeout -k 10 $((TOTAL - 30 - SECONDS)) python3 -m train.run --checkpoint "$dir/ckpt" \
    --log "$dir/out/train.log" --images "$dir/out" $args > "$dir/out/train.stdout" 2> "$dir/out/train.stderr" &
done
wait
echo "== $SECONDS s: all rounds ended"
for name in "${names[@]}"; do
  tar czf "$OUT/$name.tgz" -C ".train-$name" ckpt out
  echo "== $name"
  grep -v -E "^(tf|fewstep|rollout|codec|cont|long)[0-9]*[rh]? step" ".train-$name/out/train.stdout" | tail -n 40
  tail -n 3 ".train-$name/out/train.stderr"
done
