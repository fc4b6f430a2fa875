"""Checks an entry point runs on a validated ``EngineConfig`` before the engine builds anything.

``EngineConfig`` validation already refused what one field or the config alone shows (a device
this torch cannot use, a preset without weights, a missing model directory, a bad
``arstream.json``). What needs the file system or the machine is checked here, cheaply, so that a
mistake costs one line on the terminal instead of minutes of loading and gigabytes of memory:
the model directory's parts, their config files and that weights files are there (none is read), the
causal weights file,
whether the weights and one session fit in the memory the CPU has, and under ``gpu_memory_gib`` whether they
fit on the device at all (``engine/device_memory.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.device_memory import check_fits_on_device
from engine.memory import check_fits_in_memory, check_text_encoder_fits_host
from engine.models.loading import ModelLoadError, check_model_dir


def check_before_build(config: EngineConfig) -> None:
    """Raise a ``ValueError`` (``ModelLoadError``, ``InsufficientMemory``) naming the file or the figures."""
    if config.model_dir is not None:
        model_dir = Path(config.model_dir)
        check_model_dir(model_dir)
        # causal weights replace transformer/'s, which then needs only its config.json
        parts = ("vae", "text_encoder") if config.causal_weights is not None else ("transformer", "vae", "text_encoder")
        for part in parts:
            if not any((model_dir / part).glob("*.safetensors")):
                raise ModelLoadError(f"{model_dir / part}: no *.safetensors weights (only safetensors are read)")
    if config.causal_weights is not None and not Path(config.causal_weights).is_file():
        raise ModelLoadError(f"causal weights {config.causal_weights}: no such file")
    check_fits_in_memory(config)
    if torch.device(config.device).type == "cuda":
        check_fits_on_device(config)  # under gpu_memory_gib: the resident parts and one session
        check_text_encoder_fits_host(config)
