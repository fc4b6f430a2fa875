#!/usr/bin/env bash
# Issue 30's device-length checks of the tiny model in one device call (carry .site.tar.xz, and .train-ckpt for a
# candidate's DiT files): every motion word x 3 colour pairs for SECONDS_EACH (600) s, and the demo's example for
# HOUR_S (3600) s, on cuda, the object's area and colour per 30-s window (train.fade); MOTIONS="orbiting still"
# runs only those words. One process per motion and one for the hour, in parallel (the tiny model leaves the GPU
# mostly idle; reading frames back is the host's work).
#
#   run(command="WEIGHTS=.train-ckpt bash train/device_fade.sh", carry=[".site.tar.xz", ".train-ckpt"])
#
# $OUT holds up to six files (a call brings back at most eight: the stderr files stay on the machine in a directory
# of this run's own, so a run of fewer words prints no earlier run's tails).
# The full site and a candidate's weights pass the 64 MiB a call carries: pack the site with
# `bash bench/device/pack_site.sh --lean` (no WebRTC, no PyAV: train.fade needs neither) for such a call.
set -u
OUT=${OUT:-$PWD/out-fade}
mkdir -p "$OUT"
source bench/device/common.sh
install_wheels
nvidia-smi --query-gpu=name --format=csv,noheader
overlay=()
[ -n "${WEIGHTS:-}" ] && overlay=(--weights "$WEIGHTS")
err=$(mktemp -d)
for motion in ${MOTIONS:-bouncing drifting orbiting still}; do
  sheet=()
  [ "$motion" = bouncing ] && sheet=(--sheet "$OUT/bouncing_${SECONDS_EACH:-600}s.png")
  python3 -m train.fade --device cuda --seconds "${SECONDS_EACH:-600}" --window-s 30 --seeds 0 "${overlay[@]}" "${sheet[@]}" \
    --prompts "a red circle $motion on a blue background|a green triangle $motion on a black background|a white square $motion on a red background" \
    > "$OUT/fade_$motion.txt" 2> "$err/fade_$motion.stderr" &
done
python3 -m train.fade --device cuda --seconds "${HOUR_S:-3600}" --window-s 30 --seeds 0 "${overlay[@]}" \
  --prompts "a red circle bouncing on a blue background" > "$OUT/fade_hour.txt" 2> "$err/fade_hour.stderr" &
wait
echo "== done after $SECONDS s"
for f in "$OUT"/fade_*.txt; do echo "== $f"; grep "^|" "$f"; done
tail -n 3 "$err"/fade_*.stderr
