# syntax=docker/dockerfile:1
# arstream GPU image: the service on a CUDA build of torch, models from a mounted directory (/models).
#
#   docker build -t arstream .
#   docker run --gpus all --init -p 8000:8000 -v /srv/wan:/models:ro \
#       -e MODEL_DIR=/models -e PRESET=wan2.1-1.3b -e ARSTREAM_TOKEN=... arstream
#
# wan2.1-1.3b needs MODEL_DIR (it ships no weights); a benchmark without weights sets RANDOM_WEIGHTS=true.
#
# or docker/compose.yaml. The entrypoint maps environment variables to `arstream serve` flags
# (docker/entrypoint.sh, README "Running the image with a real model directory"). Nothing is downloaded
# at run time: the Hugging Face libraries are switched to offline mode below.
#
# CUDA: torch wheels bring their own CUDA libraries; the base image supplies the user-space driver
# hooks. cu128 runs on drivers >= 570; on hosts with driver >= 580 CUDA 13 builds work too, e.g.
#   --build-arg CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04 \
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Ubuntu 24.04's Python is 3.12 (the project needs >= 3.11). Package versions float with the
# archive's security updates on purpose.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 --user-group --shell /usr/sbin/nologin arstream

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HUB_DISABLE_TELEMETRY=1 \
    DO_NOT_TRACK=1

# torch first, from the PyTorch index (a CUDA build): the largest layer, and the one that changes least.
RUN python3 -m venv "${VIRTUAL_ENV}" \
    && pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /opt/arstream
COPY pyproject.toml README.md ./
COPY app ./app
COPY engine ./engine
COPY decoders ./decoders
RUN pip install --no-cache-dir . \
    && python -c "import app.cli, engine.models.loading"

COPY --chmod=0755 docker/entrypoint.sh /usr/local/bin/arstream-entrypoint

# The model directory (diffusers layout + optional causal weights + arstream.json), mounted read-only.
VOLUME ["/models"]
# the "arstream" user created above, by number (so a runtime can check it is not root)
USER 10001:10001
WORKDIR /home/arstream
EXPOSE 8000

# Ready = engine built, warmed and alive (/readyz 503 while loading, draining or dead). Loading a 1.3B DiT and
# the UMT5-XXL text encoder from disk and warming up takes minutes: failures only count after the start period.
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; port = os.environ.get('PORT') or os.environ.get('ARSTREAM_PORT') or '8000'; urllib.request.urlopen(f'http://127.0.0.1:{port}/readyz', timeout=8)"]

# The server exits 1 when its engine dies (device error), so a restart policy brings it back.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/arstream-entrypoint"]
CMD []
