"""Casting a diffusers module to a dtype the way diffusers itself does."""

from __future__ import annotations

import torch


def cast_keeping_fp32_modules(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model.to(dtype)`` except the submodules diffusers keeps in float32 (time embedder, norms, tables)."""
    if dtype == torch.float32:
        return model
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, parameter in model.named_parameters():
        if not any(part in keep for part in name.split(".")):
            parameter.data = parameter.data.to(dtype)
    for name, buffer in model.named_buffers():
        if buffer.is_floating_point() and not any(part in keep for part in name.split(".")):
            buffer.data = buffer.data.to(dtype)
    return model
