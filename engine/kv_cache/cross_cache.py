"""Session-scoped cross-attention K/V (text conditioning), published atomically."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.kv_cache.spec import KVSpec

CacheKey = tuple[str, str, str]  # (session_id, branch, cache name)


class CrossAttentionCache:
    """Preallocated slots of per-layer cross-attention K/V, one pool per cache name.

    A populate writes every layer into a spare slot and only then makes it the
    visible one, so a failure half way leaves the previous complete cache in
    place (or none). One spare slot per name suffices: populates run one at a
    time on the engine's worker thread.
    """

    def __init__(self, spec: KVSpec, slots_per_name: int, device: torch.device | str) -> None:
        self.spec = spec
        self._storage: dict[str, torch.Tensor] = {}
        self._free: dict[str, list[int]] = {}
        for name, length in spec.cross_attention_lengths.items():
            self._storage[name] = torch.empty(
                (slots_per_name, spec.num_layers, 2, length, spec.num_kv_heads, spec.head_dim),
                dtype=spec.dtype,
                device=device,
            )
            self._free[name] = list(range(slots_per_name - 1, -1, -1))
        self._published: dict[CacheKey, int] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._storage.values())

    def num_free_slots(self, name: str) -> int:
        return len(self._free[name])

    def is_populated(self, session_id: str, branch: str, name: str) -> bool:
        return (session_id, branch, name) in self._published

    def populate(
        self, session_id: str, branch: str, name: str, layer_kv: Iterable[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Write all layers (consumed once, in order) and publish them together."""
        if name not in self._storage:
            raise KeyError(f"unknown cross-attention cache {name!r}; known: {sorted(self._storage)}")
        if not self._free[name]:
            raise RuntimeError(f"no free cross-attention slot for {name!r}; admission is broken")
        slot = self._free[name].pop()
        storage = self._storage[name][slot]
        try:
            written = 0
            for layer, (key, value) in enumerate(layer_kv):
                if layer >= self.spec.num_layers:
                    raise ValueError("more cross-attention layers than the spec declares")
                storage[layer, 0].copy_(key.reshape(storage.shape[2:]))
                storage[layer, 1].copy_(value.reshape(storage.shape[2:]))
                written += 1
            if written != self.spec.num_layers:
                raise ValueError(f"cross-attention populate wrote {written} of {self.spec.num_layers} layers")
        except BaseException:
            self._free[name].append(slot)
            raise
        previous = self._published.get((session_id, branch, name))
        self._published[(session_id, branch, name)] = slot
        if previous is not None:
            self._free[name].append(previous)

    def read(self, session_id: str, branch: str, name: str) -> torch.Tensor:
        """``[num_layers, 2, length, heads, head_dim]`` of a populated cache."""
        slot = self._published.get((session_id, branch, name))
        if slot is None:
            raise RuntimeError(f"cross-attention cache {name!r} of branch {branch!r} read before it was populated")
        return self._storage[name][slot]

    def release(self, session_id: str, keep: Iterable[str] = ()) -> None:
        """Drop every cache of the session except the names in ``keep``."""
        keep = set(keep)
        for key in [k for k in self._published if k[0] == session_id and k[2] not in keep]:
            self._free[key[2]].append(self._published.pop(key))
