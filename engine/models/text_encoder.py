"""Text encoders: prompt → ``[B, text_len, text_dim]`` embeddings, zero-padded.

Causal Wan checkpoints attend to all ``text_len`` (512) positions without a
mask, with zeros after the prompt's tokens; every encoder here keeps that.
"""

from __future__ import annotations

from typing import Protocol

import torch


class TextEncoder(Protocol):
    text_len: int
    text_dim: int

    def encode(self, prompts: list[str]) -> torch.Tensor:
        """``[len(prompts), text_len, text_dim]`` float32 on the CPU, zero after each prompt's tokens."""
        ...


class TinyTextEncoder:
    """A seeded byte-level embedding for the toy preset: different prompts give different embeddings.

    It understands nothing; it exists so the embedded default reacts to its
    prompt the way a real model's conditioning path does. Prompts longer than
    ``text_len`` UTF-8 bytes are truncated.
    """

    def __init__(self, text_dim: int, text_len: int = 512, seed: int = 0) -> None:
        self.text_dim = text_dim
        self.text_len = text_len
        generator = torch.Generator().manual_seed(seed + 7919)
        self._bytes = torch.randn(256, text_dim, generator=generator)
        self._positions = 0.5 * torch.randn(text_len, text_dim, generator=generator)

    def encode(self, prompts: list[str]) -> torch.Tensor:
        out = torch.zeros(len(prompts), self.text_len, self.text_dim)
        for row, prompt in enumerate(prompts):
            ids = torch.tensor(list(prompt.encode("utf-8")[: self.text_len]), dtype=torch.long)
            if ids.numel():
                out[row, : ids.numel()] = self._bytes[ids] + self._positions[: ids.numel()]
        return out
