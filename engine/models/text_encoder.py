"""Text encoders: prompt → ``[B, text_len, text_dim]`` embeddings, zero-padded.

Causal Wan checkpoints attend to all ``text_len`` (512) positions without a
mask, with zeros after the prompt's tokens; every encoder here keeps that.
"""

from __future__ import annotations

import json
import re
from typing import Protocol

import torch


class TextEncoder(Protocol):
    text_len: int
    text_dim: int

    def encode(self, prompts: list[str]) -> torch.Tensor:
        """``[len(prompts), text_len, text_dim]`` float32 on the CPU, zero after each prompt's tokens."""
        ...

    def unknown_words(self, prompt: str) -> tuple[str, ...] | None:
        """The prompt's words the encoder skips, in order, each once; None when it reads any text."""
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

    def unknown_words(self, prompt: str) -> None:
        return None  # every byte has an embedding

    def encode(self, prompts: list[str]) -> torch.Tensor:
        out = torch.zeros(len(prompts), self.text_len, self.text_dim)
        for row, prompt in enumerate(prompts):
            ids = torch.tensor(list(prompt.encode("utf-8")[: self.text_len]), dtype=torch.long)
            if ids.numel():
                out[row, : ids.numel()] = self._bytes[ids] + self._positions[: ids.numel()]
        return out


class WordTextEncoder(torch.nn.Module):
    """Learned word and position embeddings over a fixed vocabulary: the trained tiny model's text encoder.

    A prompt is read as its lower-case words; words outside the vocabulary
    are skipped (so "Please show a red circle ..." reads as "a red circle ..."),
    the first ``max_words`` known words are embedded (word + position) and
    the rest of the ``text_len`` positions are zero, as the causal Wan
    checkpoints expect. A prompt with no known word encodes to all zeros.
    """

    WORD_PATTERN = re.compile(r"[a-z]+")

    def __init__(self, vocabulary: list[str] | tuple[str, ...], text_dim: int, text_len: int = 512, max_words: int = 16) -> None:
        super().__init__()
        if not vocabulary or len(set(vocabulary)) != len(vocabulary):
            raise ValueError("the vocabulary must be a non-empty list of distinct words")
        if not 0 < max_words <= text_len:
            raise ValueError(f"max_words must lie in 1..text_len ({text_len}), got {max_words}")
        self.vocabulary = tuple(vocabulary)
        self.text_dim = text_dim
        self.text_len = text_len
        self.max_words = max_words
        self._index = {word: i for i, word in enumerate(self.vocabulary)}
        self.words = torch.nn.Embedding(len(self.vocabulary), text_dim)
        self.positions = torch.nn.Parameter(torch.zeros(max_words, text_dim))

    def unknown_words(self, prompt: str) -> tuple[str, ...]:
        """What the model cannot show: the words it skips (a prompt is never refused for them)."""
        return tuple(dict.fromkeys(w for w in self.WORD_PATTERN.findall(prompt.lower()) if w not in self._index))

    def token_ids(self, prompt: str) -> list[int]:
        known = [self._index[w] for w in self.WORD_PATTERN.findall(prompt.lower()) if w in self._index]
        return known[: self.max_words]

    def embed_ids(self, ids: list[list[int]]) -> torch.Tensor:
        """``[len(ids), text_len, text_dim]`` (differentiable; for training)."""
        device = self.positions.device
        out = torch.zeros(len(ids), self.text_len, self.text_dim, device=device)
        for row, row_ids in enumerate(ids):
            if row_ids:
                index = torch.tensor(row_ids, dtype=torch.long, device=device)
                out[row, : len(row_ids)] = self.words(index) + self.positions[: len(row_ids)]
        return out

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> torch.Tensor:
        return self.embed_ids([self.token_ids(p) for p in prompts]).float().cpu()

    # -- files ---------------------------------------------------------------

    def save(self, path) -> None:
        from safetensors.torch import save_file

        metadata = {"vocabulary": json.dumps(self.vocabulary), "text_len": str(self.text_len), "max_words": str(self.max_words)}
        save_file({k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}, str(path), metadata=metadata)

    @classmethod
    def load(cls, path) -> "WordTextEncoder":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        try:
            vocabulary = json.loads(metadata["vocabulary"])
            text_len, max_words = int(metadata["text_len"]), int(metadata["max_words"])
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{path}: not a WordTextEncoder file (metadata {sorted(metadata)})") from exc
        encoder = cls(vocabulary, tensors["words.weight"].shape[1], text_len=text_len, max_words=max_words)
        encoder.load_state_dict(tensors)
        return encoder.eval()
