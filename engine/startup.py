"""Building the engine on its device thread: models, pools sized from memory, warm-up.

Runs once, before the engine core exists. The result says how many sessions
the memory holds and what one block costs on this machine (the warm-up's
blocks seed the core's running estimate).
"""

from __future__ import annotations

import dataclasses

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from engine.bundle import ModelBundle, build_models
from engine.config import EngineConfig
from engine.cpu_threads import default_threads
from engine.kv_cache import KVCacheManager, KVSpec
from engine.device_memory import DEVICE_RESERVE_BYTES, allocator_limit_bytes, estimate_device_memory, refusal
from engine.memory import InsufficientMemory, cpu_session_budget
from engine.runner import Runner, WarmupFailed, runner_for
from engine.status import Geometry

log = logging.getLogger("arstream.engine")

ACTIVATION_MARGIN = 1.25  # headroom over the measured activation peak (allocator fragmentation)


@dataclass(frozen=True)
class BuiltEngine:
    runner: Runner
    capacity: int  # sessions the memory holds
    per_session_bytes: int
    geometry: Geometry
    warmup_block_s: tuple[float, ...]  # device seconds of each warm-up block
    ticks_per_block: int  # 1 grouped; denoise steps + commit in stepwise mode
    undo_blocks: int = 0  # a session's last blocks that can be taken back (supersede; 0: off)

    @property
    def seed_block_cost_s(self) -> float | None:
        """The warm-up's steady cost: its first block pays one-time costs, so it counts only when alone."""
        blocks = self.warmup_block_s
        if not blocks:
            return None
        steady = blocks[1:] or blocks
        return sum(steady) / len(steady)


def geometry_for(config: EngineConfig, width: int, height: int, bundle: ModelBundle | None = None) -> Geometry:
    timing = bundle.audio_timing if bundle is not None else None
    return Geometry(
        width=width,
        height=height,
        fps=config.fps,
        frames_per_block=config.frames_per_block,
        pixel_frames_per_block=4 * config.frames_per_block,
        audio_sample_rate=timing.sample_rate if timing is not None else None,
        audio_channels=bundle.audio_channels if bundle is not None else None,
    )


def indexed_cuda_device(name: str) -> torch.device:
    """`name` with its index: torch's per-process memory fraction refuses a bare "cuda" (the current device)."""
    device = torch.device(name)
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


SUPERSEDE_MAX_STATE_BYTES = 256 * 2**20  # decoder state per session below which supersede is on by default
SUPERSEDE_MAX_DEVICE_SHARE = 1 / 8  # or where a session's kept copies take at most this share of the device's memory


def supersede_blocks(config: EngineConfig, decoder_state_bytes: int, device_bytes: int | None = None) -> int:
    """How many of a session's last blocks can be taken back (0: supersede off). The blocks a lead may hold
    besides the one being sent, and those in flight; never in stepwise mode (a block spans ticks).

    ``supersede`` unset: on where the decoders' state is small (the tiny codec, TAEHV), or where a session's
    state and its kept copies take at most an eighth of ``device_bytes`` (the memory the engine may use on its
    GPU): the Wan VAE's 1.8 GiB at 832x480, four copies, on an 80 or 141 GB card, not in a 24 GiB mode."""
    blocks = config.resolved_blocks_in_flight + 1
    enabled = config.supersede
    if enabled is None:
        enabled = decoder_state_bytes <= SUPERSEDE_MAX_STATE_BYTES or (
            device_bytes is not None and decoder_state_bytes * (1 + blocks) <= device_bytes * SUPERSEDE_MAX_DEVICE_SHARE)
    if not enabled or config.step_mode == "stepwise":
        return 0
    return blocks


def _device_bytes(config: EngineConfig) -> int | None:
    """The memory the engine may use on its GPU (``gpu_memory_gib``'s cap, else the card's); None on the CPU."""
    if torch.device(config.device).type != "cuda":
        return None
    limit = allocator_limit_bytes(config)
    return limit if limit is not None else torch.cuda.get_device_properties(indexed_cuda_device(config.device)).total_memory


def build_engine(config: EngineConfig, bundle: ModelBundle | None = None) -> BuiltEngine:
    """Everything the core drives; call on the device thread."""
    threads = config.cpu_threads
    if threads is None and torch.device(config.device).type == "cpu":
        threads = default_threads()  # engine/cpu_threads.py: why, and the OpenMP spin limit that goes with it
    if threads is not None:
        torch.set_num_threads(threads)
    limit = allocator_limit_bytes(config)
    if limit is not None:  # as on a card of gpu_memory_gib: the allocator refuses beyond it, the build included
        device = indexed_cuda_device(config.device)
        torch.cuda.set_per_process_memory_fraction(limit / torch.cuda.get_device_properties(device).total_memory, device)
    bundle = bundle or build_models(config)
    spec = bundle.pipeline.kv_spec()
    decoder_bytes = bundle.decoder.declared_state_bytes(bundle.height, bundle.width, config.torch_dtype)
    if bundle.audio_decoder is not None:
        decoder_bytes += bundle.audio_decoder.declared_state_bytes()
    # Supersede (engine/undo.py): each of a session's last undo_blocks blocks keeps a copy of the decoders' state
    # and the window frames its commit evicted.
    undo_blocks = supersede_blocks(config, decoder_bytes, _device_bytes(config))
    spec = dataclasses.replace(spec, held_frames=undo_blocks * spec.frames_per_block)
    decoder_bytes *= 1 + undo_blocks
    if bundle.encoder is not None:  # any session may turn live input on: its encoder state is reserved
        decoder_bytes += bundle.encoder.declared_state_bytes(bundle.height, bundle.width, config.torch_dtype)
    per_session_bytes = spec.session_bytes + decoder_bytes
    budget = config.kv_memory_budget_bytes
    activation_peak = None
    if budget is None and torch.device(config.device).type == "cuda":
        with refused_when_out_of_memory(config, lambda: activation_peak):
            budget, activation_peak = _cuda_budget(config, bundle, spec)
    elif budget is None and torch.device(config.device).type == "cpu":
        budget = cpu_session_budget()  # what the host has available now, less a reserve
    capacity = config.max_sessions
    if budget is not None:
        capacity = min(capacity, budget // per_session_bytes)
    if capacity < 1:
        if config.gpu_memory_gib is not None:
            raise InsufficientMemory(refusal(config, estimate_device_memory(config), activation_peak))
        raise ValueError(
            f"the memory budget holds no session: one needs {per_session_bytes} bytes "
            f"(KV {spec.session_bytes}, decoder {decoder_bytes}), budget {budget}"
        )
    manager = KVCacheManager(spec, int(capacity), config.device)
    stepwise = config.step_mode == "stepwise"
    runner = runner_for(bundle, manager, stepwise=stepwise, split_first_block=config.splits_first_block,
                        undo_blocks=undo_blocks, stoppable=config.stop_block_on_restart and config.cut_on_reset,
                        batch_sessions=config.batch_sessions)
    if bundle.audio_decoder is not None and bundle.audio_decoder.graphs is not None:
        bundle.audio_decoder.graphs.warmup(config.device)
    with refused_when_out_of_memory(config, lambda: activation_peak):
        warmup = runner.warmup(config.warmup_blocks) if config.warmup_blocks else []
    built = BuiltEngine(
        runner=runner,
        capacity=int(capacity),
        per_session_bytes=per_session_bytes,
        geometry=geometry_for(config, bundle.width, bundle.height, bundle),
        warmup_block_s=tuple(warmup),
        ticks_per_block=bundle.pipeline.num_steps + 1 if stepwise else 1,
        undo_blocks=undo_blocks,
    )
    log.info(
        "engine built",
        extra={"capacity": built.capacity, "warmup_block_ms": [round(s * 1000, 1) for s in warmup]},
    )
    return built


@contextmanager
def refused_when_out_of_memory(config: EngineConfig, activation_peak: Callable[[], int | None]) -> Iterator[None]:
    """Under ``gpu_memory_gib``, the allocator refusing the probe or the warm-up is the cap holding no session:
    say so with every figure (:func:`~engine.device_memory.refusal`), not with the allocator's traceback.
    The runner turns a failed block into :class:`~engine.runner.WarmupFailed`, which says whether it was that."""
    try:
        yield
    except (torch.OutOfMemoryError, WarmupFailed) as error:
        if config.gpu_memory_gib is None or not (isinstance(error, torch.OutOfMemoryError) or error.out_of_memory):
            raise
        text = str(error)
        cause = text[text.find("CUDA out of memory"):] if "CUDA out of memory" in text else text
        raise InsufficientMemory(
            refusal(config, estimate_device_memory(config), activation_peak(), out_of_memory=cause)
        ) from error


def _cuda_budget(config: EngineConfig, bundle: ModelBundle, spec: KVSpec) -> tuple[int, int]:
    """Free device memory left for sessions after a warm-up measured peak activation memory, and that peak.

    One probe session runs a block with its own pool; what the step
    allocated beyond the resident tensors is the activation peak, kept free
    (with a margin) for every later step. Under ``gpu_memory_gib`` the free memory is what the allocator's
    cap leaves, not what the card has.
    """
    device = torch.device(config.device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    probe = runner_for(bundle, KVCacheManager(spec, 1, device))
    resident = torch.cuda.memory_allocated(device)
    probe.warmup(1, transitions=False)  # one session slot: the real warm-up covers the transitions
    # One session's forward; a batch of batch_sessions holds each member's activations at once.
    activation_peak = (torch.cuda.max_memory_allocated(device) - resident) * config.batch_sessions
    del probe
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    limit = allocator_limit_bytes(config)
    if limit is not None:
        free = min(free, limit - torch.cuda.memory_reserved(device))
    staging = spec.frames_per_block * spec.block_bytes * len(spec.branch_names) * spec.staging_slots
    budget = int(free - ACTIVATION_MARGIN * activation_peak - staging - DEVICE_RESERVE_BYTES)
    # What the build and the probe hold before any session: tensors (allocated) and the allocator's reserve
    # beyond them (CUDA graph pools stay reserved after empty_cache). Allocated after the probe should be the
    # weights and workspaces alone: a reference to the probe's session once kept its whole pool here
    # (docs/BENCHMARKS.md, ninth session).
    log.info("cuda memory budget", extra={"free": free, "activation_peak": activation_peak, "budget": budget,
                                          "allocator_limit": limit, "resident_with_probe_pool": resident,
                                          "allocated_after_probe": torch.cuda.memory_allocated(device),
                                          "reserved_after_probe": torch.cuda.memory_reserved(device)})
    return max(budget, 0), activation_peak
