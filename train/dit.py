"""Stages 4-6: the causal DiT (+ audio tokens + text encoder) on latents, with the engine's block structure.

The engine runs blocks of 3 latent frames: 4 denoising steps at σ = 1, 0.9375,
0.8333, 0.625 (x0 = x − σ·v, re-noise to the next σ), then a commit pass at
t = 0 whose K/V later blocks attend to; context = sink (3 frames) + window
(15) + the block, numbered 0..20 from the oldest resident frame. Training
uses the same CausalWanTransformer forward (diffusers modules, the project's
rotary and attention processors) with a dense block-causal mask:

    teacher forcing   sequence = clean frames (t = 0) | noisy copies (t = σ per block)
                      a noisy block attends to the clean blocks before it and to itself;
                      a clean block to the clean blocks up to itself (the commit pass)

Every sequence is at most sink + window + block = 21 frames, so positions stay
inside what the engine uses; an "evicted" sample puts a clip's first block
(the sink) before a window from much later in it, as a long session sees.

    A  flow matching at random σ (shifted), all blocks at once          (tf)
    B  the engine's 4 σ, each step's input built from the model's own
       previous x0, as the engine does; x0 loss                       (fewstep)
    C  rollouts: the model generates the history itself (4 steps +
       commit), then learns the next block against the clip          (rollout)
    D  continuation: an encoded clip's first 1..6 latent frames as the
       opening context (as the engine commits an image or a clip), the
       engine's 4 steps for the next block, learned against the clip's
       next block, its frames' colours weighted up; 1/4 rollouts (C) (cont)
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import numpy as np
import torch

from engine.models.attention import DenseContext, project_cross_kv
from engine.models.causal_wan import CausalWanTransformer
from engine.models.latents import BlockLatents
from engine.models.schedule import shifted_sigmas
from train.progress import LossLog, StageClock
from train.data import LatentSet

# The decorated forward runs under no_grad; training needs the same arithmetic with gradients.
_forward = CausalWanTransformer.forward.__wrapped__
BLOCK = 3
SINK = 3
ENGINE_SIGMAS = shifted_sigmas([1000.0, 750.0, 500.0, 250.0], 5.0)
AUDIO_WEIGHT = 1.0
# The object covers ~8 % of the latent grid (its dilated footprint): weighted up, it carries ~40 % of the
# video loss. Without it the background's MSE dominates and the DiT learns the scene without its object.
OBJECT_WEIGHT = 6.0
# Continuation (D): the error of each latent frame's per-channel spatial mean (its colours, the background's
# above all) counts this much on top of the uniform MSE. A background drawn a few levels off the context's is
# a small offset on every cell: on the shipped weights, 16 clips continued after 6 latent frames of context,
# it was ~2 % of the uniform MSE (0.005 of 0.31; the rest mostly the object's cells), so it is weighted up.
# The frame mean hardly depends on where the object is, so this target is nearly noise-free.
COLOUR_WEIGHT = 8.0


def text_kv(causal: CausalWanTransformer, text_embeddings: torch.Tensor) -> torch.Tensor:
    """``project_text`` with gradients: ``[B, layers, 2, text_len, heads, head_dim]``."""
    model = causal.transformer
    states = model.condition_embedder.text_embedder(text_embeddings)
    return torch.stack([torch.stack(project_cross_kv(b.attn2, states), dim=1) for b in model.blocks], dim=1)


def doubled_mask(frames: int, tokens: int, device) -> torch.Tensor:
    block = torch.arange(frames, device=device) // BLOCK
    clean_to_clean = block.unsqueeze(1) >= block.unsqueeze(0)
    noisy_to_clean = block.unsqueeze(1) > block.unsqueeze(0)
    noisy_to_noisy = block.unsqueeze(1) == block.unsqueeze(0)
    top = torch.cat([clean_to_clean, torch.zeros_like(clean_to_clean)], dim=1)
    bottom = torch.cat([noisy_to_clean, noisy_to_noisy], dim=1)
    mask = torch.cat([top, bottom], dim=0)
    return mask.repeat_interleave(tokens, dim=0).repeat_interleave(tokens, dim=1)


def history_mask(history_frames: int, frames: int, tokens: int, device) -> torch.Tensor:
    """Block-causal over a history committed in groups of ``BLOCK`` from its first frame (the last group may be
    shorter: an opening context of 1, 4 or 5 frames, pipeline.commit_context), then the new frames as one group.
    A history of whole blocks: plain block-causal, blocks of ``BLOCK`` frames."""
    group = torch.arange(frames, device=device) // BLOCK
    group[history_frames:] = (history_frames + BLOCK - 1) // BLOCK
    group = group.repeat_interleave(tokens)
    return group.unsqueeze(1) >= group.unsqueeze(0)


def cat_frames(a: BlockLatents, b: BlockLatents) -> BlockLatents:
    return BlockLatents(torch.cat([a.video, b.video], dim=2), torch.cat([a.audio, b.audio], dim=2))


def tail_frames(x: BlockLatents, frames: int) -> BlockLatents:
    per = x.audio.shape[2] // x.video.shape[2]
    return BlockLatents(x.video[:, :, -frames:], x.audio[:, :, -frames * per :])


def teacher_forced_flow(causal, clean: BlockLatents, noisy: BlockLatents, noisy_t: torch.Tensor, cross_kv) -> BlockLatents:
    """Flow for every noisy frame, each block seeing the clean blocks before it (one dense forward)."""
    frames = clean.video.shape[2]
    cos, sin = causal.rotary(frames)
    context = DenseContext(
        cos=torch.cat([cos, cos]), sin=torch.cat([sin, sin]),
        attn_mask=doubled_mask(frames, causal.tokens_per_frame, clean.video.device),
    )
    timesteps = torch.cat([torch.zeros_like(noisy_t), noisy_t], dim=1)
    out = _forward(causal, cat_frames(clean, noisy), timesteps, context, cross_kv)
    return tail_frames(out, frames)


def block_flow(causal, history: BlockLatents | None, x: BlockLatents, timestep: float, cross_kv) -> BlockLatents:
    """Flow for one block after a clean history (the engine's forward, dense): what rollouts run. The history's
    frames are grouped as the engine committed them (:func:`history_mask`)."""
    sequence = x if history is None else cat_frames(history, x)
    frames = sequence.video.shape[2]
    cos, sin = causal.rotary(frames)
    history_frames = frames - x.video.shape[2]
    mask = history_mask(history_frames, frames, causal.tokens_per_frame, x.video.device)
    context = DenseContext(cos=cos, sin=sin, attn_mask=mask)
    batch = x.video.shape[0]
    timesteps = torch.cat(
        [torch.zeros(batch, history_frames, device=x.video.device), torch.full((batch, x.video.shape[2]), timestep, device=x.video.device)],
        dim=1,
    )
    return tail_frames(_forward(causal, sequence, timesteps, context, cross_kv), x.video.shape[2])


class Sampler:
    """Draws training sequences of ``frames`` latent frames from a :class:`LatentSet`, with per-block loss weights."""

    def __init__(self, data: LatentSet, frames: int, rng: np.random.Generator) -> None:
        if frames % BLOCK or frames > data.video.shape[2]:
            raise ValueError(f"{frames} frames: must be a multiple of {BLOCK} within the clips' {data.video.shape[2]}")
        self.data, self.frames, self.rng = data, frames, rng
        self.length = data.video.shape[2]
        self.plain = np.nonzero(data.switch.cpu().numpy() < 0)[0]  # the clips without a prompt switch

    def draw(self, batch: int, evicted_share: float = 0.3, switches: bool = True, objects: bool = False):
        """``(latents, token ids, per-block weights)``, and the ``[B, F, h, w]`` object footprints when ``objects``."""
        data, frames = self.data, self.frames
        candidates = np.arange(len(data)) if switches else self.plain
        rows = self.rng.choice(candidates, size=batch)
        videos, audios, weights, footprints = [], [], [], []
        per = data.audio.shape[2] // self.length
        for row in rows:
            switch = int(data.switch[row])
            evict = self.length >= frames + BLOCK and self.rng.random() < evicted_share
            if evict:
                starts = np.arange(2 * BLOCK, self.length - (frames - SINK) + 1, BLOCK)
                start = int(self.rng.choice(starts))
                index = list(range(SINK)) + list(range(start, start + frames - SINK))
            else:
                index = list(range(frames))
            weight = np.zeros(frames // BLOCK, dtype=np.float32)
            for b in range(frames // BLOCK):
                first = index[b * BLOCK]
                if (not evict or b == frames // BLOCK - 1) and (switch < 0 or first >= switch):
                    weight[b] = 1.0
            idx = torch.tensor(index, device=data.video.device)
            videos.append(data.video[row].index_select(1, idx))
            if objects:
                footprints.append(data.objects[row].index_select(0, idx).float())
            audio_idx = (idx.unsqueeze(1) * per + torch.arange(per, device=idx.device)).flatten()
            audios.append(data.audio[row].index_select(1, audio_idx))
            weights.append(weight)
        ids = [data.token_ids[r] for r in rows]
        weight = torch.tensor(np.stack(weights), device=data.video.device)
        latents = BlockLatents(torch.stack(videos), torch.stack(audios))
        if objects:
            return latents, ids, weight, torch.stack(footprints)
        return latents, ids, weight


def _noise_like(x: BlockLatents) -> BlockLatents:
    return BlockLatents(torch.randn_like(x.video), torch.randn_like(x.audio))


def _per_block(x: BlockLatents, sigma_per_block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """σ broadcast to video ``[B, 1, F, 1, 1]`` and audio ``[B, 1, F*A]``."""
    frames = x.video.shape[2]
    per_frame = sigma_per_block.repeat_interleave(BLOCK, dim=1)  # [B, F]
    per_audio = per_frame.repeat_interleave(x.audio.shape[2] // frames, dim=1)
    return per_frame.view(x.video.shape[0], 1, frames, 1, 1), per_audio.unsqueeze(1)


def _mix(x0: BlockLatents, noise: BlockLatents, sigma_per_block: torch.Tensor) -> BlockLatents:
    sv, sa = _per_block(x0, sigma_per_block)
    return BlockLatents((1 - sv) * x0.video + sv * noise.video, (1 - sa) * x0.audio + sa * noise.audio)


def _x0(x: BlockLatents, flow: BlockLatents, sigma_per_block: torch.Tensor) -> BlockLatents:
    sv, sa = _per_block(x, sigma_per_block)
    return BlockLatents(x.video - sv * flow.video.float(), x.audio - sa * flow.audio.float())


def _weighted_block_mse(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, frames_axis: int, per: int,
                        pixel_weight: torch.Tensor | None = None) -> torch.Tensor:
    err = (pred.float() - target.float()) ** 2
    if frames_axis == 2 and err.ndim == 5:
        if pixel_weight is None:
            per_frame = err.mean(dim=(1, 3, 4))  # [B, F]
        else:  # [B, F, h, w]
            per_frame = (err.mean(dim=1) * pixel_weight).sum(dim=(2, 3)) / pixel_weight.sum(dim=(2, 3))
    else:
        per_frame = err.mean(dim=1).view(err.shape[0], -1, per).mean(dim=2)  # audio: [B, F]
    per_block = per_frame.view(per_frame.shape[0], -1, BLOCK).mean(dim=2)
    return (per_block * weight).sum() / weight.sum().clamp_min(1.0)


def block_losses(pred: BlockLatents, target: BlockLatents, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    per = target.audio.shape[2] // target.video.shape[2]
    return (
        _weighted_block_mse(pred.video, target.video, weight, 2, per),
        _weighted_block_mse(pred.audio, target.audio, weight, 1, per),
    )


def object_losses(pred: BlockLatents, target: BlockLatents, weight: torch.Tensor, footprint: torch.Tensor) -> dict[str, torch.Tensor]:
    """The trained loss (object-weighted video + audio) and, for the log, plain video MSE and MSE on the object."""
    per = target.audio.shape[2] // target.video.shape[2]
    pixel_weight = 1.0 + OBJECT_WEIGHT * footprint
    with torch.no_grad():
        plain = _weighted_block_mse(pred.video, target.video, weight, 2, per)
        on_object = _weighted_block_mse(pred.video, target.video, weight, 2, per, footprint + 1e-6)
    video = _weighted_block_mse(pred.video, target.video, weight, 2, per, pixel_weight)
    audio = _weighted_block_mse(pred.audio, target.audio, weight, 1, per)
    return {"loss": video + AUDIO_WEIGHT * audio, "video": plain, "object": on_object, "audio": audio}


def continuation_losses(pred: BlockLatents, target: BlockLatents, footprint: torch.Tensor) -> dict[str, torch.Tensor]:
    """One block's loss: the other stages' MSE (every cell, the object's footprint weighted up) plus
    ``COLOUR_WEIGHT`` x the squared error of each frame's per-channel spatial means (the whole frame's colours,
    background included). Two CPU trials (--toy data, 32 clips, ~160 steps at 2e-4): with a uniform MSE instead,
    train.score's square and triangle shape min fell from 0.95 / 1.00 to 0.81 / 0.81; with this one they stayed;
    the seam was fixed in both (8 of 8 clips within 1.25, train.seam)."""
    per = target.audio.shape[2] // target.video.shape[2]
    ones = torch.ones(target.video.shape[0], 1, device=target.video.device)
    losses = object_losses(pred, target, ones, footprint)
    colour = ((pred.video.float().mean(dim=(3, 4)) - target.video.float().mean(dim=(3, 4))) ** 2).mean()
    return {**losses, "loss": losses["loss"] + COLOUR_WEIGHT * colour, "colour": colour}


class DiTTrainer:
    """Owns the trainable modules' optimiser across stages A-C.

    ``schedule()`` (optional) gives the learning rate before every update (the run's clock-based
    warm-up and cosine); ``on_step()`` (optional) runs after every update (periodic checkpoints).
    """

    def __init__(self, causal, text_encoder, *, lr: float, device, schedule=None, on_step=None) -> None:
        self.causal, self.text_encoder, self.device = causal, text_encoder, device
        params = list(causal.parameters()) + list(text_encoder.parameters())
        self.params = params
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.99))
        self.schedule, self.on_step = schedule, on_step
        kind = torch.device(device).type
        # bf16 on the GPU; TRAIN_AUTOCAST_CPU=1 runs the same casts on the CPU (the smoke test of that path).
        use = kind == "cuda" or os.environ.get("TRAIN_AUTOCAST_CPU") == "1"
        self.autocast_kind = kind
        self.use_autocast = use

    @property
    def autocast(self):
        return torch.autocast(self.autocast_kind, dtype=torch.bfloat16) if self.use_autocast else nullcontext()

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def cross_kv(self, ids):
        return text_kv(self.causal, self.text_encoder.embed_ids(ids))

    def update(self, loss: torch.Tensor) -> None:
        if self.schedule is not None:
            value = self.schedule()
            for group in self.optimizer.param_groups:
                group["lr"] = value
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        if self.on_step is not None:
            self.on_step()

    def _log(self, log: LossLog, stage: str, step: int, losses: dict[str, torch.Tensor], **extra: float) -> None:
        values = {k: v.item() for k, v in losses.items() if k != "loss"}
        if not all(np.isfinite(list(values.values()))):
            raise FloatingPointError(f"{stage}: non-finite loss at step {step}: {values}")
        log.write(stage, step, **values, lr=self.lr, **extra)

    # -- A: flow matching, teacher forced ----------------------------------
    def flow_matching(self, sampler: Sampler, log: LossLog, clock: StageClock, batch: int, name: str = "tf") -> int:
        step = 0
        while not clock.expired(step):
            clean, ids, weight, footprint = sampler.draw(batch, objects=True)
            blocks = clean.video.shape[2] // BLOCK
            u = torch.rand(batch, blocks, device=self.device)
            sigma = 5 * u / (1 + 4 * u)
            noise = _noise_like(clean)
            noisy = _mix(clean, noise, sigma)
            t = 1000 * sigma.repeat_interleave(BLOCK, dim=1)
            with self.autocast:
                flow = teacher_forced_flow(self.causal, clean, noisy, t, self.cross_kv(ids))
            target = BlockLatents(noise.video - clean.video, noise.audio - clean.audio)
            losses = object_losses(flow, target, weight, footprint)
            self.update(losses["loss"])
            step += 1
            if step % 50 == 0 or step == 1:
                self._log(log, name, step, losses)
        return step

    # -- B: the engine's 4 steps, teacher-forced history --------------------
    def few_step(self, sampler: Sampler, log: LossLog, clock: StageClock, batch: int, rng: np.random.Generator,
                 name: str = "fewstep") -> int:
        step = 0
        while not clock.expired(step):
            losses, target_step = self.few_step_losses(sampler, batch, rng)
            self.update(losses["loss"])
            step += 1
            if step % 50 == 0 or step == 1:
                self._log(log, name, step, losses, step_index=float(target_step))
        return step

    def few_step_losses(self, sampler: Sampler, batch: int, rng: np.random.Generator) -> tuple[dict[str, torch.Tensor], int]:
        """One few-step sample's losses (B) and the step learned: also mixed into other stages to hold what it taught."""
        clean, ids, weight, footprint = sampler.draw(batch, objects=True)
        blocks = clean.video.shape[2] // BLOCK
        target_step = int(rng.integers(len(ENGINE_SIGMAS)))
        kv = self.cross_kv(ids)
        x = _noise_like(clean)
        for index, sigma in enumerate(ENGINE_SIGMAS[: target_step + 1]):
            s = torch.full((batch, blocks), sigma, device=self.device)
            t = 1000 * s.repeat_interleave(BLOCK, dim=1)
            grad = index == target_step
            with self.autocast, (nullcontext() if grad else torch.no_grad()):
                flow = teacher_forced_flow(self.causal, clean, x, t, kv if grad else kv.detach())
            x0 = _x0(x, flow, s)
            if not grad:
                nxt = torch.full((batch, blocks), ENGINE_SIGMAS[index + 1], device=self.device)
                x = _mix(BlockLatents(x0.video.detach(), x0.audio.detach()), _noise_like(clean), nxt)
        return object_losses(x0, clean, weight, footprint), target_step

    @torch.no_grad()
    def generate_block(self, history: BlockLatents | None, shape_like: BlockLatents, kv) -> BlockLatents:
        """The engine's 4 steps for one block after ``history`` (no gradients)."""
        x = _noise_like(shape_like)
        for index, sigma in enumerate(ENGINE_SIGMAS):
            with self.autocast:
                flow = block_flow(self.causal, history, x, 1000 * sigma, kv)
            x0 = BlockLatents(x.video - sigma * flow.video.float(), x.audio - sigma * flow.audio.float())
            if index + 1 < len(ENGINE_SIGMAS):
                nxt = ENGINE_SIGMAS[index + 1]
                noise = _noise_like(shape_like)
                x = BlockLatents((1 - nxt) * x0.video + nxt * noise.video, (1 - nxt) * x0.audio + nxt * noise.audio)
        return x0

    def learned_block(self, history: BlockLatents, like: BlockLatents, kv, target_step: int, flow_of=None) -> BlockLatents:
        """The engine's steps for one block after ``history`` up to ``target_step``, only that one with
        gradients: its x0 (what rollouts and continuations learn). ``flow_of(history, x, timestep, kv)``: the
        forward to use (default :func:`block_flow` on this trainer's model)."""
        if flow_of is None:
            flow_of = lambda h, x, t, k: block_flow(self.causal, h, x, t, k)  # noqa: E731
        x = _noise_like(like)
        for index, sigma in enumerate(ENGINE_SIGMAS[: target_step + 1]):
            grad = index == target_step
            with self.autocast, (nullcontext() if grad else torch.no_grad()):
                flow = flow_of(history, x, 1000 * sigma, kv if grad else kv.detach())
            x0 = BlockLatents(x.video - sigma * flow.video.float(), x.audio - sigma * flow.audio.float())
            if not grad:
                nxt = ENGINE_SIGMAS[index + 1]
                noise = _noise_like(like)
                x = BlockLatents((1 - nxt) * x0.video.detach() + nxt * noise.video, (1 - nxt) * x0.audio.detach() + nxt * noise.audio)
        return x0

    # -- C: rollouts on the model's own history -----------------------------
    def rollout(self, sampler: Sampler, log: LossLog, clock: StageClock, batch: int, rng: np.random.Generator,
                name: str = "rollout") -> int:
        step = 0
        while not clock.expired(step):
            losses, generated = self._rollout_losses(sampler, batch, rng)
            self.update(losses["loss"])
            step += 1
            if step % 25 == 0 or step == 1:
                self._log(log, name, step, losses, generated=float(generated))
        return step

    def _rollout_losses(self, sampler: Sampler, batch: int, rng: np.random.Generator) -> tuple[dict[str, torch.Tensor], int]:
        frames = sampler.frames
        evicted = sampler.length >= frames + BLOCK and rng.random() < 0.5
        clip, ids, _, footprint = sampler.draw(batch, evicted_share=1.0 if evicted else 0.0, switches=False, objects=True)
        kv = self.cross_kv(ids)
        # The clip's first block stands in for the sink (and, in an evicted sample, the first block of the
        # later window too); the model then generates `generated` blocks; the block after them is learned.
        given = BLOCK * (2 if evicted else 1)
        max_generated = (frames - given) // BLOCK - 1
        generated = int(rng.integers(1, max_generated + 1)) if max_generated >= 1 else 0
        history = BlockLatents(clip.video[:, :, :given], clip.audio[:, :, : given * clip.audio.shape[2] // frames])
        per = clip.audio.shape[2] // frames
        for b in range(generated):
            start = given + b * BLOCK
            like = BlockLatents(clip.video[:, :, start : start + BLOCK], clip.audio[:, :, start * per : (start + BLOCK) * per])
            new = self.generate_block(history, like, kv.detach())
            history = cat_frames(history, new)
        start = given + generated * BLOCK
        target = BlockLatents(clip.video[:, :, start : start + BLOCK], clip.audio[:, :, start * per : (start + BLOCK) * per])
        x0 = self.learned_block(history, target, kv, int(rng.integers(len(ENGINE_SIGMAS))))
        ones = torch.ones(batch, 1, device=self.device)
        return object_losses(x0, target, ones, footprint[:, start : start + BLOCK]), generated

    # -- D: continuing an opening context (an image's or a clip's latents) --
    def continuation(self, sampler: Sampler, log: LossLog, clock: StageClock, batch: int, rng: np.random.Generator,
                     name: str = "cont", max_context: int = 6, rollout_share: float = 0.25,
                     own_share: float = 0.3, picture_share: float = 0.0) -> int:
        """Teach the model to continue the colours (and the object) of a context it did not make.

        The engine's image or clip start (runner._begin_from) encodes ``1 + 4 (n - 1)`` frames as a fresh codec
        stream, commits the ``n`` latent frames at positions 0.. in groups of 3 (the last may be shorter), with
        silent audio, and generates blocks of 3 after them. Stages A-C only ever condition on whole blocks of
        latents from inside a clip's stream or on the model's own blocks, and weight the object's footprint up;
        the shipped model then draws a clip's background a few levels off the context's own colour, a visible
        step at the seam (tests/test_image_to_video.py). Here a sample is exactly that start: the first ``n``
        (1..``max_context``) latent frames of a switch-free clip of the latent set (encoded from its first
        frame, so a fresh stream as the engine's), zero audio, grouped as the engine commits them; then, in
        ``own_share`` of the samples, one block the model generates itself; then the engine's 4 steps for the
        next block, learned at a random step against the clip's own next block with :func:`continuation_losses`.
        ``rollout_share`` of the steps are ordinary rollout steps (C), so text-only sessions keep what they
        had; their losses are logged as ``{name}r``. ``picture_share`` of the samples start from one latent frame
        (a picture) whatever ``n`` would have been drawn.
        """
        step = rollouts = 0
        while not clock.expired(step):
            if rng.random() < rollout_share:
                losses, generated = self._rollout_losses(sampler, batch, rng)
                self.update(losses["loss"])
                step += 1
                rollouts += 1
                if rollouts % 25 == 0 or rollouts == 1:
                    self._log(log, name + "r", step, losses, generated=float(generated))
                continue
            losses, (n, own) = self.continuation_step_losses(sampler, batch, rng, max_context, own_share, picture_share)
            self.update(losses["loss"])
            step += 1
            if (step - rollouts) % 75 == 0 or step - rollouts == 1:
                self._log(log, name, step, losses, context=float(n), own=float(own))
        return step

    def continuation_step_losses(self, sampler: Sampler, batch: int, rng: np.random.Generator, max_context: int = 6,
                                 own_share: float = 0.3, picture_share: float = 0.0) -> tuple[dict[str, torch.Tensor], tuple[int, int]]:
        """One continuation sample's losses (D, see :meth:`continuation`) and its context (latent frames, own
        block or not): also mixed into the long-rollout stage to hold the seam at a continued clip."""
        data = sampler.data
        length = data.video.shape[2]
        per = data.audio.shape[2] // length
        own = int(rng.random() < own_share)
        n = int(rng.integers(1, min(max_context, length - BLOCK * (1 + own)) + 1))
        if picture_share > 0 and rng.random() < picture_share:
            n = 1
        picks = rng.choice(sampler.plain, size=batch)
        rows = torch.as_tensor(picks, device=data.video.device)
        video = data.video.index_select(0, rows)
        audio = data.audio.index_select(0, rows)
        footprint = data.objects.index_select(0, rows)
        kv = self.cross_kv([data.token_ids[r] for r in picks])
        history = BlockLatents(video[:, :, :n], torch.zeros_like(audio[:, :, : n * per]))
        if own:
            like = BlockLatents(video[:, :, n : n + BLOCK], audio[:, :, n * per : (n + BLOCK) * per])
            history = cat_frames(history, self.generate_block(history, like, kv.detach()))
        start = n + own * BLOCK
        target = BlockLatents(video[:, :, start : start + BLOCK], audio[:, :, start * per : (start + BLOCK) * per])
        x0 = self.learned_block(history, target, kv, int(rng.integers(len(ENGINE_SIGMAS))))
        return continuation_losses(x0, target, footprint[:, start : start + BLOCK]), (n, own)


@torch.no_grad()
def sample_session(trainer: DiTTrainer, ids: list[list[int]], blocks: int, like: BlockLatents, window: int = 15) -> BlockLatents:
    """Generate ``blocks`` blocks from nothing, as the engine does: 4 steps per block after a context of the
    first block (sink) + the last ``window`` frames. ``like``: one block's shapes (batch = len(ids))."""
    kv = trainer.cross_kv(ids)
    frames: BlockLatents | None = None
    for _ in range(blocks):
        history = None
        if frames is not None:
            resident = frames.video.shape[2]
            if resident > SINK + window:
                per = frames.audio.shape[2] // resident
                keep = list(range(SINK)) + list(range(resident - window, resident))
                idx = torch.tensor(keep, device=frames.video.device)
                audio_idx = (idx.unsqueeze(1) * per + torch.arange(per, device=idx.device)).flatten()
                history = BlockLatents(frames.video.index_select(2, idx), frames.audio.index_select(2, audio_idx))
            else:
                history = frames
        new = trainer.generate_block(history, like, kv)
        frames = new if frames is None else cat_frames(frames, new)
    return frames
