"""The AR block loop (Self-Forcing / CausVid semantics) over a session's paged KV.

One block of ``frames_per_block`` latent frames::

    x ← ε₀                                   (σ₀ = 1)
    for i, σ in enumerate(σs):               (4 forwards)
        v  ← model(x, t = 1000·σ)
        x0 ← x − σ·v
        x  ← (1 − σᵢ₊₁)·x0 + σᵢ₊₁·εᵢ₊₁       (not after the last step; fresh ε)
    model(x0, t = 0) → stage K/V → commit   (1 forward: the block's clean K/V)

A block with an input (live video-to-video: the input's latents ``z``) starts part-way down the same
schedule instead, at a step ``k`` the client's strength chose: ``x ← (1 − σₖ)·z + σₖ·ε``, then steps
``k .. N−1``; with ``k = N`` (strength 0) the block is ``z`` itself and only the commit pass runs. An
image or a clip (already clean latents) is committed as the session's opening context by
:meth:`CausalWanPipeline.commit_context`, the commit pass alone, block-causally.

The pipeline holds no session table: the runner passes a session's KV state
and progress to every call, which is the binding.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch

from engine.kv_cache import KVSpec, SessionKVState
from engine.models.attention import GatheredContext, PagedContext
from engine.models.causal_wan import CausalWanTransformer
from engine.models.context_kv import ContextKV
from engine.models.forward_graphs import GraphedForwards
from engine.models.latents import BlockLatents
from engine.models.prompt_embeddings import PromptEmbeddings
from engine.models.text_encoder import TextEncoder

PromptPolicy = Literal["soft", "recache", "reset"]
TEXT_CACHE = "text"


@dataclass
class SessionProgress:
    """Model-owned state of one session: RNG, conditioning, the block in flight, resident clean latents."""

    seed: int
    generator: torch.Generator
    prompt: str
    negative_prompt: str
    text: dict[str, torch.Tensor]  # branch -> [1, text_len, text_dim]
    block_index: int = 0
    step_index: int = 0  # 0..num_steps-1: denoise steps; num_steps: the commit pass
    latents: BlockLatents | None = None  # x_t of the block in flight, float32
    clean: BlockLatents | None = None  # x0 of the block in flight, float32
    # The next block's input (model-space latents, float32) and the schedule step it starts at; None: noise.
    block_input: BlockLatents | None = None
    first_step: int = 0
    # Clean latents of the frames whose K/V are resident, in history order (for recache).
    sink_latents: list[BlockLatents] = field(default_factory=list)
    window_latents: deque = field(default_factory=deque)

    def resident_latents(self) -> list[BlockLatents]:
        return self.sink_latents + list(self.window_latents)

    def nbytes(self) -> int:
        """Bytes of the tensors this state holds now."""
        held = self.resident_latents() + [x for x in (self.latents, self.clean, self.block_input) if x is not None]
        return sum(x.nbytes for x in held)


def draw_noise(
    generator: torch.Generator, video_shape: tuple[int, ...], audio_shape: tuple[int, ...] | None, device
) -> BlockLatents:
    """Fresh ε for one block: video first, then audio, on the CPU from the session's generator.

    Drawn on the CPU so a seed gives the same frames on any device; copied to
    a GPU from pinned memory without blocking, so the host never waits for the
    device inside a block (a pageable copy would wait for every queued kernel).
    """
    video = _to_device(torch.randn(video_shape, generator=generator), device)
    audio = None if audio_shape is None else _to_device(torch.randn(audio_shape, generator=generator), device)
    return BlockLatents(video, audio)


def _to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    device = torch.device(device)
    if device.type != "cuda":
        return tensor.to(device)
    # The caching host allocator keeps the pinned block until the copy has run.
    return tensor.pin_memory().to(device, non_blocking=True)


class CausalWanPipeline:
    """Runs AR blocks of a :class:`CausalWanTransformer` with paged sink + window KV."""

    def __init__(
        self,
        transformer: CausalWanTransformer,
        text_encoder: TextEncoder,
        *,
        sigmas: list[float],
        frames_per_block: int,
        sink_frames: int,
        window_frames: int,
        guidance_scale: float = 1.0,
        gather_history_once: bool = True,
        cuda_graphs: bool = False,
        text_encode_in_background: bool = False,
        batch_slots: int = 1,
    ) -> None:
        """``gather_history_once``: gather (and rotate) a block's history once for its forwards
        (:class:`ContextKV`); ``False`` gathers it in every forward, the reference path. ``cuda_graphs``:
        replay each forward shape as a CUDA graph (needs the gathered history; :class:`GraphedForwards`).
        ``text_encode_in_background``: new prompts are encoded on their own thread once requested
        (:class:`PromptEmbeddings`; for a slow encoder, e.g. on the CPU beside a GPU). ``batch_slots``: the most
        sessions :meth:`run_blocks` runs in one forward (each needs its own gathered context and staging slot)."""
        if batch_slots < 1:
            raise ValueError("batch_slots must be >= 1")
        if batch_slots > 1 and not gather_history_once:
            raise ValueError("batched forwards need gather_history_once=True (a gathered context slot per session)")
        if not sigmas or sigmas[0] != 1.0:
            raise ValueError("the first σ must be 1 (a block starts from pure noise)")
        if transformer.fp8_attention and not gather_history_once:
            raise ValueError(
                "FP8 attention needs gather_history_once=True: its history is quantized once per block into the "
                "gathered context's FP8 mirror; the per-forward gather path has none"
            )
        self.transformer = transformer
        self.text_encoder = text_encoder
        self.sigmas = list(sigmas)
        self.frames_per_block = frames_per_block
        self.sink_frames = sink_frames
        self.window_frames = window_frames
        self.guidance_scale = guidance_scale
        self.batch_slots = batch_slots
        self.branch_names: tuple[str, ...] = ("cond", "uncond") if guidance_scale > 1.0 else ("cond",)
        config = transformer.transformer.config
        p_t, p_h, p_w = config.patch_size
        self.latent_shape = (
            1,
            config.in_channels,
            frames_per_block,
            transformer.patch_rows * p_h,
            transformer.patch_cols * p_w,
        )
        self.audio_shape = None
        if transformer.audio is not None:
            self.audio_shape = (1, transformer.audio.audio_dim, frames_per_block * transformer.audio.tokens_per_frame)
        self.embeddings = PromptEmbeddings(text_encoder, background=text_encode_in_background)
        self._pool_writes = 0  # bumped by every write into the block pool: a loaded context is stale after one
        self.forwards = GraphedForwards(transformer, enabled=cuda_graphs and gather_history_once)
        self.context_kv: dict[str, ContextKV] = {}
        if gather_history_once:
            max_tokens = (sink_frames + window_frames + frames_per_block) * transformer.tokens_per_frame
            self.context_kv = {
                branch: ContextKV(
                    num_layers=transformer.num_layers,
                    max_tokens=max_tokens,
                    num_heads=transformer.num_heads,
                    head_dim=transformer.head_dim,
                    tokens_per_frame=transformer.tokens_per_frame,
                    dtype=transformer.dtype,
                    device=transformer.device,
                    fp8_attention=transformer.fp8_attention,
                    cuda_graphs=cuda_graphs,
                    slots=batch_slots,
                )
                for branch in self.branch_names
            }

    def variant(self, *, gather_history_once: bool, cuda_graphs: bool = False, batch_slots: int = 1) -> "CausalWanPipeline":
        """The same model, schedule and windows on other execution paths (the reference for equivalence checks)."""
        return CausalWanPipeline(
            self.transformer,
            self.text_encoder,
            sigmas=self.sigmas,
            frames_per_block=self.frames_per_block,
            sink_frames=self.sink_frames,
            window_frames=self.window_frames,
            guidance_scale=self.guidance_scale,
            gather_history_once=gather_history_once,
            cuda_graphs=cuda_graphs,
            batch_slots=batch_slots,
        )

    # --- what the runner needs to build pools ---------------------------
    @property
    def num_steps(self) -> int:
        return len(self.sigmas)

    def kv_spec(self) -> KVSpec:
        t = self.transformer
        _, channels, frames, height, width = self.latent_shape
        frame_bytes = channels * height * width * 4
        if self.audio_shape is not None:
            frame_bytes += self.audio_shape[1] * self.audio_shape[2] // frames * 4
        # resident clean latents (for recache) + the opening context kept for a reset (at most as many)
        # + x_t, x0 and the input of the block in flight
        resident = self.sink_frames + self.window_frames
        model_state = (2 * resident + 3 * frames) * frame_bytes
        return KVSpec(
            num_layers=t.num_layers,
            num_kv_heads=t.num_heads,
            head_dim=t.head_dim,
            tokens_per_frame=t.tokens_per_frame,
            frames_per_block=self.frames_per_block,
            sink_frames=self.sink_frames,
            window_frames=self.window_frames,
            branch_names=self.branch_names,
            cross_attention_lengths={TEXT_CACHE: self.text_encoder.text_len},
            model_state_bytes=model_state,
            dtype=t.dtype,
            staging_slots=self.batch_slots,
        )

    # --- conditioning -----------------------------------------------------
    def embed(self, prompt: str) -> torch.Tensor:
        """Text embeddings of one prompt, cached (:class:`PromptEmbeddings`, bounded)."""
        return self.embeddings.get(prompt)

    def _texts(self, prompt: str, negative_prompt: str) -> dict[str, torch.Tensor]:
        texts = {"cond": self.embed(prompt)}
        if "uncond" in self.branch_names:
            texts["uncond"] = self.embed(negative_prompt)
        return texts

    def new_progress(self, seed: int, prompt: str, negative_prompt: str = "") -> SessionProgress:
        return SessionProgress(
            seed=seed,
            generator=torch.Generator().manual_seed(seed),
            prompt=prompt,
            negative_prompt=negative_prompt,
            text=self._texts(prompt, negative_prompt),
        )

    def set_prompt(
        self, kv: SessionKVState, progress: SessionProgress, prompt: str, negative_prompt: str, policy: PromptPolicy
    ) -> None:
        """Switch conditioning for the next block; self-KV is kept (``soft``) or recomputed (``recache``).

        ``reset`` is not handled here: it restarts the whole session, which is
        the runner's release path.
        """
        if policy not in ("soft", "recache"):
            raise ValueError(f"set_prompt handles 'soft' and 'recache', not {policy!r}")
        old = progress.text
        progress.prompt, progress.negative_prompt = prompt, negative_prompt
        progress.text = self._texts(prompt, negative_prompt)
        kv.clear_cross_attention()
        if policy == "recache":
            changed = [b for b in self.branch_names if not torch.equal(old[b], progress.text[b])]
            self.recache(kv, progress, changed)

    def _cross_kv(self, kv: SessionKVState, progress: SessionProgress, branch: str) -> torch.Tensor:
        if not kv.is_cross_populated(branch, TEXT_CACHE):
            projected = self.transformer.project_text(progress.text[branch])[0]  # [layers, 2, len, H, D]
            kv.populate_cross(branch, TEXT_CACHE, ((layer[0], layer[1]) for layer in projected))
        return kv.read_cross(branch, TEXT_CACHE)

    # --- the block loop ---------------------------------------------------
    def forward_branch(
        self,
        kv: SessionKVState,
        progress: SessionProgress,
        branch: str,
        latents: BlockLatents,
        timestep: float,
        *,
        stage: bool,
    ) -> BlockLatents:
        """One forward of one KV branch for a session at ``timestep`` (``stage``: the commit pass, its K/V into
        the staging buffer). Every forward of the block loop goes through here: the one seam where tests
        inject a failure and benchmarks time forwards."""
        frames = latents.frames
        staging = kv.staging(branch) if stage else None
        context = self._attention_context(kv, branch, kv.resident_block_ids(branch), frames, staging)
        frame_timesteps = torch.full((1, frames), float(timestep), device=self.transformer.device)
        cross_kv = self._cross_kv(kv, progress, branch)
        return self.forwards(latents.to(self.transformer.device), frame_timesteps, context, cross_kv)

    def _attention_context(
        self, kv: SessionKVState, branch: str, history_ids: list[int], frames: int, staging: torch.Tensor | None
    ) -> GatheredContext | PagedContext:
        """Context for a forward of ``frames`` frames after the history frames ``history_ids`` (oldest first)."""
        cos, sin = self.transformer.rotary(len(history_ids) + frames)
        workspace = self.context_kv.get(branch)
        if workspace is not None:
            # The same ids after the same pool writes hold the same K/V: a block's forwards share one load.
            # The session by weak reference: the buffer outlives sessions, and must not keep a released one's
            # state (and through it its manager's whole pool) alive; a dead reference equals no live one.
            owner = (weakref.ref(kv), branch, tuple(history_ids), self._pool_writes)
            history_tokens = workspace.load(owner, kv.pool, history_ids, cos, sin, self.transformer.kernels.rotate_pairs)
            return GatheredContext(
                cos=cos, sin=sin, stage=staging, context_kv=workspace.buffer, history_tokens=history_tokens,
                fp8=workspace.fp8,
            )
        ids = None
        if history_ids and len(history_ids) == kv.num_resident_blocks(branch):
            ids = kv.history(branch)[0]  # the table keeps its ids on the device
        elif history_ids:
            ids = torch.tensor(history_ids, dtype=torch.long).to(self.transformer.device)
        return PagedContext(cos=cos, sin=sin, pool=kv.pool, history_ids=ids, stage=staging)

    def _flow(self, kv: SessionKVState, progress: SessionProgress, latents: BlockLatents, timestep: float) -> BlockLatents:
        cond = self.forward_branch(kv, progress, "cond", latents, timestep, stage=False).float()
        if "uncond" not in self.branch_names:
            return cond
        uncond = self.forward_branch(kv, progress, "uncond", latents, timestep, stage=False).float()
        return uncond.combine(cond, 1.0 - self.guidance_scale, self.guidance_scale)

    def _noise(self, progress: SessionProgress) -> BlockLatents:
        return draw_noise(progress.generator, self.latent_shape, self.audio_shape, self.transformer.device)

    # --- inputs: an opening context, a block's input -----------------------
    def first_step_for(self, strength: float) -> int:
        """The schedule step a block with input starts at for ``strength`` in [0, 1]: the point of the schedule
        (σ₀ … σ_{N−1}, and 0) nearest to it, ``N`` meaning no denoising step (ties go to the stronger)."""
        if not 0.0 <= strength <= 1.0:
            raise ValueError("strength must lie in [0, 1]")
        points = self.sigmas + [0.0]
        return min(range(len(points)), key=lambda k: (abs(points[k] - strength), k))

    def strength_at(self, first_step: int) -> float:
        """The noise level σ a block starting at ``first_step`` takes its input to (0 after the last step)."""
        return (self.sigmas + [0.0])[first_step]

    def set_block_input(self, progress: SessionProgress, latents: BlockLatents, first_step: int) -> None:
        """The next block starts from ``latents`` (model space) taken to σ of ``first_step`` (see the module doc)."""
        if progress.latents is not None or progress.clean is not None:
            raise RuntimeError("a block is in flight; its input was fixed when it began")
        if not 0 <= first_step <= self.num_steps:
            raise ValueError(f"first_step must lie in [0, {self.num_steps}]")
        if latents.video.shape != self.latent_shape:
            raise ValueError(f"block input must be {self.latent_shape}; got {tuple(latents.video.shape)}")
        progress.block_input, progress.first_step = latents.to(self.transformer.device, torch.float32), first_step

    def commit_context(self, kv: SessionKVState, progress: SessionProgress, context: BlockLatents) -> None:
        """Commit clean latents (an image: 1 frame; a clip: up to ``sink + window``) as the session's history,
        before its first block: the commit pass alone, in groups of ``frames_per_block``, each group attending
        to the ones before it, at positions 0, 1, … — as the model commits what it makes itself."""
        if progress.block_index or kv.num_resident_blocks(self.branch_names[0]):
            raise RuntimeError("an opening context goes before the session's first block")
        if context.frames > self.sink_frames + self.window_frames:
            raise ValueError(f"a context holds at most {self.sink_frames + self.window_frames} latent frames")
        context = context.to(self.transformer.device, torch.float32)
        for group in BlockLatents.cat_groups(context, self.frames_per_block):
            self._commit(kv, progress, group)

    def _commit(self, kv: SessionKVState, progress: SessionProgress, clean: BlockLatents) -> None:
        """The commit pass: ``clean``'s K/V staged in every branch at t = 0, then committed to the history."""
        for branch in self.branch_names:
            self.forward_branch(kv, progress, branch, clean, 0.0, stage=True)
        # Every branch's forward succeeded: only now does anything enter the cache.
        self._pool_writes += 1
        for branch in self.branch_names:
            kv.commit(branch, clean.frames)
        self._remember_clean(progress, clean)

    def _begin_block(self, progress: SessionProgress) -> None:
        """x of the block's first step: noise, or its input taken to that step's σ (or, at strength 0, x0 itself)."""
        given, first = progress.block_input, progress.first_step if progress.block_input is not None else 0
        progress.step_index = first
        if first == self.num_steps:
            progress.clean = given
            return
        noise = self._noise(progress)
        sigma = self.sigmas[first]
        progress.latents = noise if given is None else given.combine(noise, 1.0 - sigma, sigma)

    def step(self, kv: SessionKVState, progress: SessionProgress) -> BlockLatents | None:
        """Advance the session's block by one forward; return the block's clean latents after its commit."""
        if progress.latents is None and progress.clean is None:
            self._begin_block(progress)
        index = progress.step_index
        if index < self.num_steps:
            sigma = self.sigmas[index]
            flow = self._flow(kv, progress, progress.latents, 1000.0 * sigma)
            progress.clean = progress.latents.combine(flow, 1.0, -sigma)
            if index + 1 < self.num_steps:
                next_sigma = self.sigmas[index + 1]
                progress.latents = progress.clean.combine(self._noise(progress), 1.0 - next_sigma, next_sigma)
            progress.step_index += 1
            return None
        clean = progress.clean
        self._commit(kv, progress, clean)
        progress.block_index += 1
        progress.step_index = 0
        progress.latents = None
        progress.clean = None
        progress.block_input = None
        progress.first_step = 0
        return clean

    def denoise_step(self, kv: SessionKVState, progress: SessionProgress) -> BlockLatents | None:
        """One denoising forward; the block's clean latents once the last one ran (its commit pass still to come).

        Lets a caller show a block before its commit: the commit pass (the next
        :meth:`step`) changes nothing the block's frames depend on.
        """
        if progress.latents is None and progress.clean is None:
            self._begin_block(progress)
        if progress.step_index >= self.num_steps:
            if progress.latents is None and progress.clean is not None:
                return progress.clean  # a block whose input needs no denoising (strength 0)
            raise RuntimeError("the block is denoised; its commit pass is next")
        self.step(kv, progress)
        return progress.clean if progress.step_index == self.num_steps else None

    def run_block(self, kv: SessionKVState, progress: SessionProgress) -> BlockLatents:
        """All remaining steps of the current block (grouped execution); same result as stepping."""
        self.denoise_block(kv, progress)
        return self.commit_block(kv, progress)

    def denoise_block(self, kv: SessionKVState, progress: SessionProgress) -> BlockLatents:
        """All remaining denoising forwards of the current block, not its commit pass; its clean latents.

        The block's frames do not depend on its commit (it only adds the block's K/V to the history the next
        block reads), so a caller may decode them first and :meth:`commit_block` after."""
        if progress.latents is None and progress.clean is None:
            self._begin_block(progress)
        while progress.step_index < self.num_steps:
            self.step(kv, progress)
        return progress.clean

    def commit_block(self, kv: SessionKVState, progress: SessionProgress) -> BlockLatents:
        """The commit pass of a denoised block (:meth:`denoise_block`); the session's next block follows it."""
        if progress.clean is None or progress.step_index < self.num_steps:
            raise RuntimeError("the block is not denoised yet")
        return self.step(kv, progress)

    # --- several sessions' blocks in one forward ---------------------------
    def can_batch(self, progress: SessionProgress) -> bool:
        """Whether the session's next block may join a batch (:meth:`run_blocks`): a plain block from noise,
        not begun, on the gathered-history path."""
        return (bool(self.context_kv) and progress.latents is None and progress.clean is None
                and progress.block_input is None)

    def batch_key(self, kv: SessionKVState) -> tuple[int, ...]:
        """Sessions batch only with equal keys: a batch's forwards share one history length (its rotary
        positions, its kernels' shapes), so the same count of resident frames in every branch."""
        return tuple(kv.num_resident_blocks(branch) for branch in self.branch_names)

    def run_blocks(self, members: list[tuple[SessionKVState, SessionProgress]]) -> list[BlockLatents]:
        """The next block of every member (denoising and commit), each step one forward for all of them: the
        clean latents of each, in order. Each session's block is the one :meth:`run_block` makes of it (its own
        noise, history and prompt), within the batched kernels' rounding (tests/test_batched_blocks.py); one
        member runs :meth:`run_block` itself."""
        self.denoise_blocks(members)
        return self.commit_blocks(members)

    def denoise_blocks(self, members: list[tuple[SessionKVState, SessionProgress]],
                       stopped: Callable[[], Iterable[int]] | None = None) -> list[BlockLatents | None]:
        """:meth:`run_blocks`' denoising forwards alone (as :meth:`denoise_block`); their clean latents.

        ``stopped``: asked before each step which members (positions in ``members``) stop there; a stopped
        member leaves the batch as if its block had never begun (its noise generator too: begun again, it is the
        block never stopped), its entry None, and the others go on (alone: the one-session path)."""
        self._check_batch(members)
        if len(members) == 1 and stopped is None:
            return [self.denoise_block(*members[0])]
        begun = [progress.generator.get_state() for _, progress in members]
        for _, progress in members:
            self._begin_block(progress)  # each session's noise from its own generator, in run_block's order
        going = list(range(len(members)))
        for index in range(self.num_steps):
            for position in set(stopped() if stopped is not None else ()) & set(going):
                going.remove(position)
                progress = members[position][1]
                progress.latents = progress.clean = None
                progress.step_index = 0
                progress.generator.set_state(begun[position])
            if not going:
                break
            batch = [members[position] for position in going]
            sigma = self.sigmas[index]
            latents = BlockLatents.stack([progress.latents for _, progress in batch])
            flow = self._flow_batch(batch, latents, 1000.0 * sigma)
            for row, (_, progress) in enumerate(batch):
                progress.clean = progress.latents.combine(flow.row(row), 1.0, -sigma)
                if index + 1 < self.num_steps:
                    next_sigma = self.sigmas[index + 1]
                    progress.latents = progress.clean.combine(self._noise(progress), 1.0 - next_sigma, next_sigma)
                progress.step_index += 1
        return [members[position][1].clean if position in going else None for position in range(len(members))]

    def commit_blocks(self, members: list[tuple[SessionKVState, SessionProgress]]) -> list[BlockLatents]:
        """The commit pass of denoised blocks (:meth:`denoise_blocks`) in one forward per branch, each session's
        K/V staged in its own slot and committed only once every forward has succeeded."""
        if len(members) == 1:
            return [self.commit_block(*members[0])]
        for _, progress in members:
            if progress.clean is None or progress.step_index < self.num_steps:
                raise RuntimeError("a member's block is not denoised yet")
        cleans = [progress.clean for _, progress in members]
        batch = BlockLatents.stack(cleans)
        for branch in self.branch_names:
            self._forward_batch(members, branch, batch, 0.0, stage=True)
        self._pool_writes += 1
        for slot, ((kv, progress), clean) in enumerate(zip(members, cleans)):
            for branch in self.branch_names:
                kv.commit(branch, clean.frames, slot=slot)
            self._remember_clean(progress, clean)
            progress.block_index += 1
            progress.step_index = 0
            progress.latents = progress.clean = progress.block_input = None
            progress.first_step = 0
        return cleans

    def _check_batch(self, members: list[tuple[SessionKVState, SessionProgress]]) -> None:
        if not 1 <= len(members) <= self.batch_slots:
            raise ValueError(f"a batch of {len(members)} sessions; this pipeline batches 1 to {self.batch_slots}")
        if len({id(kv) for kv, _ in members}) != len(members):
            raise ValueError("a session appears twice in one batch")
        if len(members) == 1:
            return
        first = members[0][0]
        for kv, progress in members:
            if not self.can_batch(progress):
                raise ValueError("only plain blocks from noise, not begun, batch (no input, no step taken)")
            if self.batch_key(kv) != self.batch_key(first):
                raise ValueError("a batch's sessions must hold the same number of history frames")
            if kv.pool.data_ptr() != first.pool.data_ptr() or \
                    kv.staging(self.branch_names[0]).data_ptr() != first.staging(self.branch_names[0]).data_ptr():
                raise ValueError("a batch's sessions must share one KV manager (its pool and staging slots)")

    def _flow_batch(self, members, latents: BlockLatents, timestep: float) -> BlockLatents:
        cond = self._forward_batch(members, "cond", latents, timestep, stage=False).float()
        if "uncond" not in self.branch_names:
            return cond
        uncond = self._forward_batch(members, "uncond", latents, timestep, stage=False).float()
        return uncond.combine(cond, 1.0 - self.guidance_scale, self.guidance_scale)

    def _forward_batch(self, members, branch: str, latents: BlockLatents, timestep: float, *, stage: bool) -> BlockLatents:
        """:meth:`forward_branch` for a batch: session ``b``'s history loaded into context slot ``b`` (each slot
        keeps its own load while its owner is unchanged), its commit staged in staging slot ``b``. A batch left
        with one member (the others stopped) runs :meth:`forward_branch` itself: the one-session forward and its
        graphs."""
        if len(members) == 1:
            return self.forward_branch(*members[0], branch, latents, timestep, stage=stage)
        batch, frames = len(members), latents.frames
        history = [kv.resident_block_ids(branch) for kv, _ in members]
        cos, sin = self.transformer.rotary(len(history[0]) + frames)
        workspace = self.context_kv[branch]
        tokens = 0
        for slot, ((kv, _), ids) in enumerate(zip(members, history)):
            owner = (weakref.ref(kv), branch, tuple(ids), self._pool_writes)
            tokens = workspace.load(owner, kv.pool, ids, cos, sin, self.transformer.kernels.rotate_pairs, slot)
        staging = members[0][0].staging_batch(branch, batch) if stage else None
        context = GatheredContext(cos=cos, sin=sin, stage=staging, context_kv=workspace.buffers[:batch],
                                  history_tokens=tokens, fp8=workspace.fp8)
        frame_timesteps = torch.full((batch, frames), float(timestep), device=self.transformer.device)
        cross_kv = tuple(self._cross_kv(kv, progress, branch) for kv, progress in members)
        return self.forwards(latents.to(self.transformer.device), frame_timesteps, context, cross_kv)

    def history_changed(self) -> None:
        """A session's KV history was changed outside a commit (blocks taken back): no gathered history is
        reused after it."""
        self._pool_writes += 1

    def _remember_clean(self, progress: SessionProgress, clean: BlockLatents) -> None:
        for frame in clean.split_frames():
            if len(progress.sink_latents) < self.sink_frames:
                progress.sink_latents.append(frame)
            else:
                if len(progress.window_latents) == self.window_frames:
                    progress.window_latents.popleft()
                progress.window_latents.append(frame)

    def recache(self, kv: SessionKVState, progress: SessionProgress, branches: list[str] | None = None) -> None:
        """Recompute resident K/V under the current prompt (LongLive's recache), in place.

        The resident frames are re-run block-causally in groups of
        ``frames_per_block`` at t = 0, at the same context positions they hold
        now, each group attending to the already recomputed groups before it.
        """
        frames = progress.resident_latents()
        group = self.frames_per_block
        for branch in branches if branches is not None else self.branch_names:
            block_ids = kv.resident_block_ids(branch)
            if len(block_ids) != len(frames):
                raise RuntimeError("resident latents and KV blocks disagree; session state is corrupt")
            for start in range(0, len(block_ids), group):
                targets = block_ids[start : start + group]
                latents = BlockLatents.cat(frames[start : start + group])
                context = self._attention_context(kv, branch, block_ids[:start], len(targets), kv.staging(branch))
                timesteps = torch.zeros((1, len(targets)), device=self.transformer.device)
                self.forwards(latents, timesteps, context, self._cross_kv(kv, progress, branch))
                self._pool_writes += 1
                kv.overwrite(branch, targets)
