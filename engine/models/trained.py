"""Weights shipped in the package for a preset (engine/models/weights/<name>/), one safetensors file per module.

    transformer.safetensors   WanTransformer3DModel state dict; metadata: rope_spatial_theta, the rotary base of its
                              rows and columns when it is not Wan's 10000 (engine.models.rope)
    codec.safetensors         the TAEHV-class video codec: encoder.* and decoder.* tensors (decoders.taehv_encoder,
                              decoders.taehv); metadata: latents_mean, latents_std (JSON lists) of its latents
    audio_vae.safetensors     AutoencoderOobleck state dict
    audio_tokens.safetensors  AudioTokenProjections state dict
    text_encoder.safetensors  WordTextEncoder (vocabulary in its metadata)

They are loaded into modules built from the preset's own configs, so a file
that does not fit the architecture fails loudly (load_state_dict is strict).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from engine.models.rope import ROPE_THETA
from engine.models.text_encoder import WordTextEncoder

ROPE_SPATIAL_THETA_KEY = "rope_spatial_theta"


def rope_spatial_theta(path: Path) -> float:
    """The spatial rotary base a transformer file was trained with: its metadata's, else Wan's."""
    with safe_open(str(path), framework="pt") as handle:
        value = (handle.metadata() or {}).get(ROPE_SPATIAL_THETA_KEY)
    if value is None:
        return ROPE_THETA
    try:
        theta = float(value)
    except ValueError:
        raise ValueError(f"{path}: metadata {ROPE_SPATIAL_THETA_KEY}={value!r} is not a number") from None
    if not theta > 1.0:
        raise ValueError(f"{path}: metadata {ROPE_SPATIAL_THETA_KEY}={value!r} must be above 1")
    return theta

WEIGHTS_ROOT = Path(__file__).parent / "weights"


@dataclass(frozen=True)
class TrainedWeights:
    directory: Path

    def _path(self, name: str) -> Path:
        path = self.directory / f"{name}.safetensors"
        if not path.is_file():
            raise FileNotFoundError(f"shipped weights are incomplete: {path} is missing")
        return path

    def load(self, name: str, module: torch.nn.Module) -> None:
        module.load_state_dict(load_file(str(self._path(name))))

    def load_codec_half(self, module: torch.nn.Module) -> None:
        """The codec file's tensors of ``module`` (its keys start ``encoder.`` or ``decoder.``), strictly."""
        tensors = load_file(str(self._path("codec")))
        prefix = next(iter(module.state_dict())).split(".")[0] + "."
        module.load_state_dict({key: value for key, value in tensors.items() if key.startswith(prefix)})

    def rope_spatial_theta(self) -> float:
        return rope_spatial_theta(self._path("transformer"))

    def latent_stats(self) -> dict[str, list[float]]:
        """The codec's latent statistics measured at training time (the decoder denormalises with them)."""
        with safe_open(str(self._path("codec")), framework="pt") as handle:
            metadata = handle.metadata() or {}
        try:
            return {"latents_mean": json.loads(metadata["latents_mean"]), "latents_std": json.loads(metadata["latents_std"])}
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{self._path('codec')}: no latents_mean / latents_std metadata") from exc

    def text_encoder(self) -> WordTextEncoder:
        return WordTextEncoder.load(self._path("text_encoder"))


def trained_weights(weights: str | None, random_weights: bool) -> TrainedWeights | None:
    """The preset's shipped weights, or None for seeded random weights (asked for, or none shipped)."""
    if random_weights or weights is None:
        return None
    return TrainedWeights(WEIGHTS_ROOT / weights)
