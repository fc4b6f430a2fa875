"""CUDA graphs of the text encoder: one per padded token length, so a prompt's encode is one replay.

A prompt is a few dozen tokens: UMT5-XXL's 24 layers at that size are hundreds of small kernels whose
launches, not their arithmetic, set the time (docs/BENCHMARKS.md), and
the encode sits on every new session's path to its first media. A graph replays them in one launch.

A graph has fixed shapes, so the tokens are padded to the smallest of a few lengths (``bucket_for``)
with mask 0: the mask gives padding zero attention weight and every other op is per token, so the
prompt's states do not depend on the padding (the same property that lets a batch pad to its longest
prompt). All lengths are captured together at the first encode — the engine's warm-up — never after.
One prompt at a time (the engine encodes one per session); a batch runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from decoders.graph_capture import GraphCache, capture

TOKEN_BUCKETS = (16, 32, 64, 128, 256)
WARMUP_RUNS = 2  # eager runs before a capture


def token_buckets(text_len: int) -> tuple[int, ...]:
    """The padded lengths for prompts of up to ``text_len`` tokens (``text_len`` is always the last)."""
    return tuple(b for b in TOKEN_BUCKETS if b < text_len) + (text_len,)


def bucket_for(length: int, buckets: tuple[int, ...]) -> int:
    for bucket in buckets:
        if length <= bucket:
            return bucket
    raise ValueError(f"{length} tokens is more than the encoder's {buckets[-1]}")


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [1, bucket] static input
    mask: torch.Tensor
    states: torch.Tensor  # [1, bucket, dim] static output


class GraphedTextEncoder:
    """``encoder(ids, mask) -> states`` on the encoder's device: CUDA graphs for one prompt, eager otherwise.

    ``encoder`` takes ``[B, L]`` token ids and attention mask and returns ``[B, L, dim]`` states (a UMT5
    encoder's ``last_hidden_state``). If a capture fails, every call runs eagerly (logged once).
    """

    def __init__(self, encoder: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], text_len: int, device) -> None:
        self.encoder = encoder
        self.device = torch.device(device)
        self.buckets = token_buckets(text_len)
        self._graphs: GraphCache[_Captured] = GraphCache(
            "text encoder", len(self.buckets), enabled=self.device.type == "cuda"
        )
        self.replays = 0

    @property
    def enabled(self) -> bool:
        return self._graphs.enabled

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.enabled and ids.shape[0] == 1 and not len(self._graphs):
            self._capture_all()
        length = ids.shape[1]
        captured = self._graphs.get(bucket_for(length, self.buckets)) if self.enabled and ids.shape[0] == 1 else None
        if captured is None:  # a batch, or a capture failed (every call is eager then)
            return self.encoder(ids.to(self.device), mask.to(self.device))
        captured.ids.zero_()
        captured.mask.zero_()
        captured.ids[:, :length].copy_(ids, non_blocking=True)
        captured.mask[:, :length].copy_(mask, non_blocking=True)
        captured.graph.replay()
        self.replays += 1
        return captured.states[:, :length]

    def _capture_all(self) -> None:
        """Every bucket, at once; one output is live at a time, so the graphs share their memory."""
        for bucket in self.buckets:
            ids = torch.zeros(1, bucket, dtype=torch.long, device=self.device)
            mask = torch.zeros(1, bucket, dtype=torch.long, device=self.device)
            ids[:, 0], mask[:, 0] = 1, 1  # one real token (</s>): no row is all padding

            def record(pool, ids=ids, mask=mask) -> _Captured:
                graph, states = capture(lambda: self.encoder(ids, mask), warm_runs=WARMUP_RUNS, pool=pool,
                                        device=self.device)
                return _Captured(graph, ids, mask, states)

            if self._graphs.capture(bucket, record) is None:  # an op a graph cannot hold: eager, as before
                return
