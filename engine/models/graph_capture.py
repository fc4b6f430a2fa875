"""Recording one CUDA graph: the side-stream warm-up that capture needs, then the capture itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def capture(fn: Callable[[], T], *, warm_runs: int = 1, pool=None, device=None) -> tuple[torch.cuda.CUDAGraph, T]:
    """``fn()`` recorded as a CUDA graph in ``pool``; returns the graph and the outputs its replays overwrite.

    ``warm_runs`` eager runs come first, on a side stream as capture requires: kernels pick their
    algorithms, cuBLAS/cuDNN their workspaces and lazy modules initialise there, not in the recording.
    They write what the replays will write again.
    """
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warm_runs):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = fn()
    return graph, output
