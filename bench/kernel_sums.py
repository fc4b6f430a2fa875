"""CUDA kernel time in a ``torch.profiler`` trace, summed by kind and by name (the benches' shared tally).

``kinds``: ``(kind, substrings of a kernel's name)`` pairs, first match wins, ``"other"`` for none.
"""

from __future__ import annotations

import torch


def kind_of(name: str, kinds) -> str:
    lowered = name.lower()
    for kind, needles in kinds:
        if any(needle in lowered for needle in needles):
            return kind
    return "other"


def cuda_kernel_sums(trace, kinds, name_chars: int) -> tuple[dict[str, float], dict[str, list]]:
    """(µs by kind, ``[µs, calls]`` by name cut to ``name_chars``) over the trace's CUDA kernels."""
    by_kind: dict[str, float] = {}
    by_name: dict[str, list] = {}
    for event in trace.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = event.time_range.elapsed_us()
        kind = kind_of(event.name, kinds)
        by_kind[kind] = by_kind.get(kind, 0.0) + us
        entry = by_name.setdefault(event.name[:name_chars], [0.0, 0])
        entry[0] += us
        entry[1] += 1
    return by_kind, by_name
