"""Small real engines for CPU tests: the tiny preset at a few dozen pixels, seeded."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.bundle import ModelBundle, build_models
from engine.runner import Runner, runner_for

# Toy models on a 2-core machine shared with servers the tests start: one intra-op thread is
# several times faster than two that spin against each other (docs/BENCHMARKS.md).
torch.set_num_threads(1)

# 64x48 pixels -> 8x6 latent -> 4x3 patches: non-square, so a row/column mix-up shows.
SMALL = {"height": 48, "width": 64}


def small_config(**overrides) -> EngineConfig:
    # The seeded random model: these tests pin its cost and output (the shipped weights have their own tests).
    values = {**SMALL, "cpu_threads": None, "warmup_blocks": 0, "max_sessions": 4, "random_weights": True}
    values.update(overrides)
    return EngineConfig(**values)


def build_small(**overrides) -> tuple[EngineConfig, ModelBundle]:
    config = small_config(**overrides)
    return config, build_models(config)


def small_runner(max_sessions: int = 4, stepwise: bool = False, **overrides) -> Runner:
    config, bundle = build_small(max_sessions=max_sessions, **overrides)
    manager = KVCacheManager(bundle.pipeline.kv_spec(), max_sessions, "cpu")
    return runner_for(bundle, manager, stepwise=stepwise)


def assert_lively(frames) -> None:
    """Decoded output is finite, varied, and not a constant image."""
    tensor = torch.as_tensor(frames, dtype=torch.float32)
    assert torch.isfinite(tensor).all()
    assert tensor.std() > 1.0, "frames are (nearly) constant"
