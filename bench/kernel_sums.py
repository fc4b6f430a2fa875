"""CUDA kernel time in a ``torch.profiler`` trace, summed by kind and by name (the benches' shared tally).

``kinds``: ``(kind, substrings of a kernel's name)`` pairs, first match wins, ``"other"`` for none.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

DIT_KINDS = (  # a DiT forward's kernels: (kind, substrings of a kernel's name), first match wins
    ("attention", ("flash", "fmha", "attn", "attention", "sdpa")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "scaled_mm", "f8f8", "sm90")),
    ("compiled", ("triton",)),
)


def profiled(fn: Callable[[], None], runs: int, cuda: bool):
    """A ``torch.profiler`` trace of ``runs`` calls of ``fn`` (the device's kernels too on CUDA, all finished)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as trace:
        for _ in range(runs):
            fn()
        if cuda:
            torch.cuda.synchronize()
    return trace


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
