#!/usr/bin/env bash
# Control to screen on the H200, in one device call (the device tool: carry .whl):
#
#     bash bench/device/run_control_latency.sh [TOTAL_S=560]
#
# Each part starts `arstream serve` and measures its first session after /readyz from an outside client
# (bench/control_to_screen.py): 20 prompt changes, alternating soft (the object's colour) and reset (the
# background), one every 3 s of playback, 52 s of streaming (CHANGES=16). Parts (each on unless set to 0):
# 1. FAST: the 1.3B fast config, window 6 + TAEHV + FP8 attention (random weights: timed by chunk.controls);
#    FAST_BLOCKS="2 1" (off unless set): the same with blocks of N latent frames, once per length listed;
# 2. TINY: the tiny model on cuda, frames read back (pixels), and the lead as it was before in the same run;
# 3. TINY_LIVE: the tiny model on cuda, a camera stream with a moving marker as live input (strength 0);
#    LIVE_BLOCK=N (off unless set): the same again with blocks of N latent frames;
#    FAST_LIVE="3 1" (off unless set): the fast 1.3B with the same camera stream, timed by chunk.input_frame
#    (random weights: no marker to read), once per block length listed; FAST_LIVE_VARIANTS (below) with settings;
# 4. STANDARD: the 1.3B standard config, window 15 + the Wan VAE, bf16 (supersede on by default on an 80 GB card or
#    larger since the twentieth session; STANDARD_SUPERSEDE=1 sets it on anyway); STANDARD_REF=1: first the same with
#    ARSTREAM_ENGINE__SUPERSEDE_RESERVE=false (just in time, the lead as before the twentieth session), or with
#    STANDARD_REF_ENV="NAME=value ..." instead (e.g. ARSTREAM_ENGINE__STOP_BLOCK_ON_RESTART=false);
# 5. GPU_TESTS: the GPU tests of supersede (bit for bit against the reference on CUDA) and dispatching ahead.
# SPREAD=S: each interval between changes longer by a seeded draw in [0, S) s (a block's playback, 0.75 s, samples
# every phase of the block; 3 s alone is 4 blocks and times the same phase each time).
# TRANSPORT=both runs each prompt part over the socket and then over WebRTC (issue 29; needs aiortc's wheels in
# .whl: aiortc, aioice, pylibsrtp, pyee, google-crc32c, pyopenssl, dnspython, ifaddr, and cryptography + cffi +
# pycparser unless the image has them: about 8 MB, which with av's 36 MB is just over the 64 MiB a call carries
# unless the image holds cryptography; `python3 bench/device/check_wheels.py --wheels .whl` says).
# Everything lands in $OUT: one JSON per part and a tarball of the logs.
set -u -o pipefail
# shellcheck source=bench/device/common.sh
. bench/device/common.sh
start_run "${1:-560}"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader || true
CHANGES=${CHANGES:-16}
TRANSPORT=${TRANSPORT:-websocket}
# A fresh 1.3B server took 45-97 s to /readyz on an H100 (2026-12-05): a part's default limit is 180 s per server it
# starts (each transport, and the tiny reference, is a server of its own); each run's JSON is written as it ends.
SERVERS=$([ "$TRANSPORT" = both ] && echo 2 || echo 1)

bench() {  # NAME LIMIT_S ARGS... (bench/control_to_screen.py's, then -- and `arstream serve`'s)
  local name=$1 limit=$2; shift 2
  echo "== $(left)s left: $name (limit ${limit}s)"
  timeout -k 10 "$limit" python3 bench/control_to_screen.py --spread "${SPREAD:-0}" --out "$OUT/$name.json" --log-dir "$OUT/logs" --tag "${name}_" "$@" \
    > /dev/null 2> "$OUT/logs/$name.stderr"
  echo "$name exit $?"; tail -n 6 "$OUT/logs/$name.stderr"
}

if [ "${FAST:-1}" = 1 ]; then
  ARSTREAM_ENGINE__VIDEO_DECODER=taehv bench fast_prompt "${FAST_S:-$((180 * SERVERS))}" --changes "$CHANGES" --interval 3 \
    --transport "$TRANSPORT" -- \
    --preset wan2.1-1.3b --device cuda --dtype bfloat16 --random-weights --window-frames 6 --fp8 attention
fi
for blocks in ${FAST_BLOCKS:-}; do  # the fast config's prompt changes with blocks of N latent frames (3 above)
  ARSTREAM_ENGINE__VIDEO_DECODER=taehv ARSTREAM_ENGINE__FRAMES_PER_BLOCK=$blocks bench "fast_prompt_block$blocks" \
    "${FAST_S:-$((180 * SERVERS))}" --changes "$CHANGES" --interval 3 --transport "$TRANSPORT" -- \
    --preset wan2.1-1.3b --device cuda --dtype bfloat16 --random-weights --window-frames 6 --fp8 attention
done
if [ "${TINY:-1}" = 1 ]; then
  # shellcheck disable=SC2046  # TINY_REF=0: without the reference run (the lead as before)
  bench tiny_prompt "${TINY_S:-$((180 * (SERVERS + ${TINY_REF:-1})))}" --changes "$CHANGES" --interval 3 --read-pixels --transport "$TRANSPORT" \
    $([ "${TINY_REF:-1}" = 1 ] && echo --reference) -- --preset tiny --device cuda
fi
if [ "${TINY_LIVE:-1}" = 1 ]; then
  bench tiny_live 75 --live 0 --seconds 25 -- --preset tiny --device cuda
fi
if [ -n "${LIVE_BLOCK:-}" ]; then  # the same with blocks of LIVE_BLOCK latent frames (a live block waits for its input)
  ARSTREAM_ENGINE__FRAMES_PER_BLOCK=$LIVE_BLOCK bench "tiny_live_block$LIVE_BLOCK" 75 --live 0 --seconds 25 -- \
    --preset tiny --device cuda
fi
for blocks in ${FAST_LIVE:-}; do
  ARSTREAM_ENGINE__VIDEO_DECODER=taehv ARSTREAM_ENGINE__FRAMES_PER_BLOCK=$blocks bench "fast_live_block$blocks" 120 \
    --live 0 --seconds 25 -- --preset wan2.1-1.3b --device cuda --dtype bfloat16 --random-weights --window-frames 6 \
    --fp8 attention
done
# FAST_LIVE_VARIANTS="LABEL:BLOCKS:NAME=value,NAME=value ..." (off unless set): the fast camera run again with those
# settings, e.g. "wanenc:1:ARSTREAM_ENGINE__VIDEO_ENCODER=wan" (the Wan VAE's encoder, as before the 22nd session).
for variant in ${FAST_LIVE_VARIANTS:-}; do
  IFS=: read -r label blocks settings <<< "$variant"
  # shellcheck disable=SC2086  # each NAME=value a word
  (export ${settings//,/ }; ARSTREAM_ENGINE__VIDEO_DECODER=taehv ARSTREAM_ENGINE__FRAMES_PER_BLOCK=$blocks \
    bench "fast_live_${label}_block$blocks" 120 --live 0 --seconds 25 -- --preset wan2.1-1.3b --device cuda \
    --dtype bfloat16 --random-weights --window-frames 6 --fp8 attention)
done
if [ "${STANDARD:-1}" = 1 ]; then
  [ "${STANDARD_SUPERSEDE:-0}" = 1 ] && export ARSTREAM_ENGINE__SUPERSEDE=true
  if [ "${STANDARD_REF:-0}" = 1 ]; then  # the reference first: just in time, no lead kept for a block made again
    # shellcheck disable=SC2086  # the variables' words, each NAME=value
    (export ${STANDARD_REF_ENV:-ARSTREAM_ENGINE__SUPERSEDE_RESERVE=false}; bench standard_prompt_reference \
      "$(( $(left) / 2 - 30 < ${STANDARD_S:-170} ? $(left) / 2 - 30 : ${STANDARD_S:-170} ))" \
      --changes "$CHANGES" --interval 3 -- --preset wan2.1-1.3b --device cuda --dtype bfloat16 --random-weights)
  fi
  bench standard_prompt "$(( $(left) - 60 < ${STANDARD_S:-170} ? $(left) - 60 : ${STANDARD_S:-170} ))" \
    --changes "$CHANGES" --interval 3 -- --preset wan2.1-1.3b --device cuda --dtype bfloat16 --random-weights
fi
if [ "${GPU_TESTS:-1}" = 1 ] && [ "$(left)" -gt 30 ]; then
  gpu_tests "$(( $(left) - 10 ))" ${GPU_TEST_FILES:-tests/test_supersede.py tests/test_blocks_in_flight.py}
fi

tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
ls -la "$OUT"
echo "== done, $(left)s left"
