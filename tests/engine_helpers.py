"""Small real engines for CPU tests: the tiny preset at a few dozen pixels, seeded."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.bundle import ModelBundle, build_models
from engine.models import presets
from engine.models.presets import TINY_TRANSFORMER_CONFIG
from engine.runner import Runner, runner_for

# Toy models on a 2-core machine shared with servers the tests start: one intra-op thread is
# several times faster than two that spin against each other (docs/BENCHMARKS.md).
torch.set_num_threads(1)

# 64x48 pixels -> 8x6 latent -> 4x3 patches: non-square, so a row/column mix-up shows.
SMALL = {"height": 48, "width": 64}

# A smaller DiT than the tiny preset's (2 layers, 2 heads, FFN 128: the preset's size until 2026-12-02) for
# the tests that build their own transformer or model directory to check a property of the code path
# (loading, causal == full sequence, FP8 against bf16), not what the shipped weights show: the same code at
# a quarter of the preset's CPU time.
SMALL_TRANSFORMER_CONFIG = {**TINY_TRANSFORMER_CONFIG, "num_attention_heads": 2, "ffn_dim": 128, "num_layers": 2}


@contextlib.contextmanager
def small_dit_tiny_preset():
    """The tiny preset with SMALL_TRANSFORMER_CONFIG's DiT while the block runs, for tests whose cost, not result,
    depends on the DiT's size (random weights only: the shipped weights are the preset's size)."""
    original = presets.PRESETS["tiny"]
    presets.PRESETS["tiny"] = dataclasses.replace(original, transformer_config=SMALL_TRANSFORMER_CONFIG)
    try:
        yield
    finally:
        presets.PRESETS["tiny"] = original


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


def fp8_batched_against_serial(*, fused_qk: bool, blocks: int, **overrides) -> dict:
    """Two sessions' blocks through one batched forward a step (``CausalWanPipeline.run_blocks``) against the same
    sessions one at a time: the tiny preset with the small DiT, bf16, ``fp8 all`` (``overrides``: the window, the
    schedule). ``fused_qk``: q and k through :mod:`engine.models.qk_quantize` (the GPU's path: a launch per
    session into its slot of the FP8 mirror and of the commit staging); else the CPU's per-head quantizer. Each
    block's largest relative error over the two sessions, and their history frames at the end."""
    with small_dit_tiny_preset():
        _, bundle = build_small(dtype="bfloat16", fp8="all", **overrides)
    serial = bundle.pipeline
    serial.transformer.kernels = dataclasses.replace(serial.transformer.kernels, quantized_norms=fused_qk)
    batched = serial.variant(gather_history_once=True, batch_slots=2)

    def sessions(pipeline):
        manager = KVCacheManager(pipeline.kv_spec(), 2, "cpu")
        return [(manager.open_session(f"s{i}"), pipeline.new_progress(seed=3 + i, prompt=f"a kite over dunes {i}"))
                for i in range(2)]

    def relative(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm())

    one, two = sessions(serial), sessions(batched)
    errors = []
    for _ in range(blocks):
        alone = [serial.run_block(kv, progress) for kv, progress in one]
        errors.append(max(relative(a.video, b.video) for a, b in zip(batched.run_blocks(two), alone)))
    return {"errors": errors, "history_frames": [kv.num_resident_blocks("cond") for kv, _ in two],
            "fused": batched.transformer.kernels.quantized_norms}


def assert_lively(frames) -> None:
    """Decoded output is finite, varied, and not a constant image."""
    tensor = torch.as_tensor(frames, dtype=torch.float32)
    assert torch.isfinite(tensor).all()
    assert tensor.std() > 1.0, "frames are (nearly) constant"


def run_async(coroutine, timeout_s: float = 120.0):
    """Run one test scenario to its end on a fresh event loop (bounded: a hang fails the test)."""
    return asyncio.run(asyncio.wait_for(coroutine, timeout=timeout_s))


async def take_chunks(engine, session_id: str, count: int) -> list:
    """The session's next ``count`` chunks (fails if the session ends first)."""
    chunks = []
    async for chunk in engine.chunks(session_id):
        chunks.append(chunk)
        if len(chunks) == count:
            return chunks
    raise AssertionError("the session ended")


@contextlib.asynccontextmanager
async def stepped_core(config: EngineConfig, completions: ThreadPoolExecutor | None = None):
    """An engine core stepped by the test itself (no engine loop): what runs when is the test's choice
    (``completions``: the executor its completions are waited on, e.g. one the test holds shut)."""
    from engine.core import EngineCore
    from engine.plan import StepPlan
    from engine.startup import build_engine

    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-device")
    built = await asyncio.get_running_loop().run_in_executor(executor, build_engine, config)
    core = EngineCore(config, built, executor, completions=completions)
    try:
        yield core
    finally:
        core.finish_all("test")
        await core.drain()
        await asyncio.get_running_loop().run_in_executor(
            executor, core.runner.execute, StepPlan(finished=core.take_finished()))
        executor.shutdown(wait=True)
