#!/usr/bin/env bash
# Container entrypoint: environment variables -> `arstream serve` flags, then exec the server (it becomes
# PID 1's child under `--init`, or PID 1 itself, and gets SIGTERM directly: it drains and exits).
#
#   MODEL_DIR        --model            model directory (diffusers layout), e.g. /models
#   CAUSAL_WEIGHTS   --causal-weights   original-format causal DiT weights (.safetensors / .pt)
#   PRESET           --preset           tiny | wan2.1-1.3b (frame size; geometry comes from MODEL_DIR)
#   RANDOM_WEIGHTS   --random-weights   true: seeded random weights, no MODEL_DIR (benchmarks only: noise)
#   HOST             --host             default 0.0.0.0 (unless ARSTREAM_HOST is set)
#   PORT             --port             default 8000 (unless ARSTREAM_PORT is set)
#   DEVICE           --device           default cuda (unless ARSTREAM_ENGINE__DEVICE is set)
#   DTYPE            --dtype            default bfloat16 (unless ARSTREAM_ENGINE__DTYPE is set)
#   HEIGHT, WIDTH    --height, --width
#   SINK_FRAMES      --sink-frames      (unset: the model directory's arstream.json, else 3)
#   WINDOW_FRAMES    --window-frames    (unset: the model directory's arstream.json, else 15)
#   GUIDANCE         --guidance
#   MAX_SESSIONS     --max-sessions
#   WARMUP_BLOCKS    --warmup-blocks
#   LOG_FORMAT       --log-format       json | text
#   ENVIRONMENT      --environment      development | production
#   ALLOWED_ORIGINS  --allowed-origin   comma-separated, one flag each
#
# Every other setting is read by the service itself from ARSTREAM_* variables (ARSTREAM_TOKEN,
# ARSTREAM_ENGINE__MAX_SESSIONS, ...); a flag set here wins over the matching ARSTREAM_* variable.
# Arguments given to the container are appended: `docker run IMAGE --lead-chunks 3`.
set -euo pipefail

args=(serve)

add() {  # add FLAG VALUE: only when VALUE is not empty
    if [[ -n "${2:-}" ]]; then
        args+=("$1" "$2")
    fi
}

# Container defaults apply only where neither the short variable nor the service's own ARSTREAM_* one is set.
add --host "${HOST:-${ARSTREAM_HOST:-0.0.0.0}}"
add --port "${PORT:-${ARSTREAM_PORT:-8000}}"
if [[ -z "${ARSTREAM_ENGINE__DEVICE:-}" ]]; then
    add --device "${DEVICE:-cuda}"
else
    add --device "${DEVICE:-}"
fi
if [[ -z "${ARSTREAM_ENGINE__DTYPE:-}" ]]; then
    add --dtype "${DTYPE:-bfloat16}"
else
    add --dtype "${DTYPE:-}"
fi

add --model "${MODEL_DIR:-}"
add --causal-weights "${CAUSAL_WEIGHTS:-}"
add --preset "${PRESET:-}"
case "${RANDOM_WEIGHTS:-}" in
    true | 1 | yes) args+=(--random-weights) ;;
    "" | false | 0 | no) ;;
    *) echo "arstream-entrypoint: RANDOM_WEIGHTS=${RANDOM_WEIGHTS} must be true or false" >&2; exit 2 ;;
esac
add --height "${HEIGHT:-}"
add --width "${WIDTH:-}"
add --sink-frames "${SINK_FRAMES:-}"
add --window-frames "${WINDOW_FRAMES:-}"
add --guidance "${GUIDANCE:-}"
add --max-sessions "${MAX_SESSIONS:-}"
add --warmup-blocks "${WARMUP_BLOCKS:-}"
add --log-format "${LOG_FORMAT:-}"
add --environment "${ENVIRONMENT:-}"

if [[ -n "${ALLOWED_ORIGINS:-}" ]]; then
    IFS=',' read -r -a origins <<< "${ALLOWED_ORIGINS}"
    for origin in "${origins[@]}"; do
        origin="${origin//[[:space:]]/}"
        add --allowed-origin "${origin}"
    done
fi

if [[ -n "${MODEL_DIR:-}" && ! -d "${MODEL_DIR}" ]]; then
    echo "arstream-entrypoint: MODEL_DIR=${MODEL_DIR} is not a directory; mount the model directory there" >&2
fi

exec arstream "${args[@]}" "$@"
