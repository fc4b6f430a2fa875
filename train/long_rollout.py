"""Stage E: long rollouts, learned against the world (issue 30, part 1).

A session runs for hours on the model's own blocks; the earlier stages only
ever learn a block after a history of at most ~5 generated blocks, and learn
it against a clip whose object is not where the model's history put it. A fast
object then fades once a session has run a few seconds: every block is the
error-minimising smear between where the model drew it and where the clip has
it, and the smears compound.

Here the model rolls out a session exactly as the engine serves it (blocks of
``block`` latent frames, the sink's first frames kept, a window of the latest
ones, four steps per block from noise) for many blocks, past the window's
first eviction; at a random point it learns the next block against what the
world would show next *from where the model's own frames put the object*:
the last frames are decoded, the object is read back (world.measure), the
motion word's trajectory nearest to it is fitted (world.fit), and that path is
rendered in the prompt's colours and encoded (the expert's continuation, as
in DAgger). A sample whose object cannot be read back any more (faded, or not
one object) teaches nothing this step; the rollout goes on.

The rollouts are the engine's own (train's modules in a CausalWanPipeline
with a paged KV cache: the same blocks a session gets, at the cost of a
served block). The learned block's history is recomputed densely, as every
other stage does: each resident frame attends to the frames committed with or
before it (its group = its original block), positions numbered from the
oldest resident. Before the window's first eviction that is the engine's
forward exactly (tests/test_train.py); after it, the engine's cached K/V of
the window's older frames were made while frames now evicted were resident,
which a dense recompute cannot see (an approximation every stage shares).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.models.attention import DenseContext
from engine.models.latents import BlockLatents
from train.data import latent_footprint
from train.dit import ENGINE_SIGMAS, OBJECT_WEIGHT, _forward, cat_frames
from train.progress import LossLog, StageClock
from world import measure
from world.clips import AUDIO_FRAMES_PER_LATENT, random_scene
from world.fit import Fit, nearest_trajectory
from world.grammar import Scene
from world.render import render_with_coverage
from world.sound import features_along

FPS = 16
# Latent frames decoded to read the object back: 1 + 4 * 2 = 9 video frames (0.56 s).
READ_LATENTS = 3
# The fit is trusted when the object was read in this many of those frames and the path passes this close.
MIN_TRACKED = 6
MAX_FIT_ERROR_PX = 6.0
# Latent frames encoded before the target block, so the encoder's memory has seen the path (as in a clip).
ENCODE_CONTEXT = 2


def resident_mask(groups: torch.Tensor, tokens: int) -> torch.Tensor:
    """Each frame attends to the frames of its group and the groups before (a block sees itself and the
    committed blocks before it): ``groups`` ``[F]`` -> ``[F * tokens, F * tokens]``."""
    g = groups.repeat_interleave(tokens)
    return g.unsqueeze(1) >= g.unsqueeze(0)


def resident_flow(causal, history: BlockLatents | None, groups: torch.Tensor, x: BlockLatents, timestep: float,
                  cross_kv) -> BlockLatents:
    """Flow for the new block ``x`` after the resident ``history`` (``groups``: one per history frame and the new
    block's, ``[F_history + F_new]``)."""
    sequence = x if history is None else cat_frames(history, x)
    frames, new = sequence.video.shape[2], x.video.shape[2]
    cos, sin = causal.rotary(frames)
    context = DenseContext(cos=cos, sin=sin, attn_mask=resident_mask(groups, causal.tokens_per_frame))
    batch, device = x.video.shape[0], x.video.device
    timesteps = torch.cat([torch.zeros(batch, frames - new, device=device), torch.full((batch, new), timestep, device=device)], dim=1)
    out = _forward(causal, sequence, timesteps, context, cross_kv)
    per = out.audio.shape[2] // frames
    return BlockLatents(out.video[:, :, -new:], out.audio[:, :, -new * per :])


@dataclass
class Session:
    """A batch of sessions' committed latents (model space) and each latent frame's block number."""

    video: torch.Tensor  # [B, 16, L, h, w]
    audio: torch.Tensor  # [B, 8, 20 L]
    groups: list[int]

    @property
    def length(self) -> int:
        return self.video.shape[2]

    def resident(self, sink: int, window: int) -> tuple[BlockLatents, list[int]]:
        """The frames the engine keeps: the first ``sink`` and the last ``window`` (all while they fit)."""
        if self.length <= sink + window:
            keep = list(range(self.length))
        else:
            keep = list(range(sink)) + list(range(self.length - window, self.length))
        idx = torch.tensor(keep, device=self.video.device)
        per = AUDIO_FRAMES_PER_LATENT
        audio_idx = (idx.unsqueeze(1) * per + torch.arange(per, device=idx.device)).flatten()
        history = BlockLatents(self.video.index_select(2, idx), self.audio.index_select(2, audio_idx))
        return history, [self.groups[i] for i in keep]


class WorldTargets:
    """What the world shows next from where a session's own frames put the object."""

    def __init__(self, codec, mean: torch.Tensor, std: torch.Tensor, device, free_orbit: bool = False) -> None:
        """``free_orbit``: fit an orbit's centre and radius too (a latent set drawn with ``orbit_spread``), so a
        session's orbit off the world's one circle is continued on its own circle instead of left unlearned."""
        self.codec, self.device, self.free_orbit = codec, device, free_orbit
        self.mean = torch.as_tensor(mean, device=device).view(1, -1, 1, 1, 1)
        self.std = torch.as_tensor(std, device=device).view(1, -1, 1, 1, 1)

    @torch.no_grad()
    def read_paths(self, session: Session) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per sample, the session-clock times (s) and centroids of the frames of the last ``READ_LATENTS``
        latent frames in which the object reads back as one object."""
        if session.length < READ_LATENTS:
            raise ValueError(f"a session of {session.length} latent frames: at least {READ_LATENTS} are read")
        first = session.length - READ_LATENTS
        latents = session.video[:, :, first:] * self.std + self.mean
        video = self.codec.decode_video(latents.float())  # [B, 3, 1 + 4 (n - 1), H, W] in [-1, 1]
        pixels = ((video.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 4, 1).cpu().numpy()
        paths = []
        for frames in pixels:
            times, xs, ys = [], [], []
            for i, frame in enumerate(frames):
                reading = measure.read_frame(frame)
                if reading.has_object:
                    times.append((4 * first + i) / FPS)
                    xs.append(reading.centroid[0])
                    ys.append(reading.centroid[1])
            paths.append((np.array(times), np.array(xs), np.array(ys)))
        return paths

    def fit(self, scene: Scene, path) -> Fit | None:
        times, xs, ys = path
        if len(times) < MIN_TRACKED:
            return None
        fit = nearest_trajectory(scene.motion, times, xs, ys, free_orbit=self.free_orbit)
        return fit if fit.error_px <= MAX_FIT_ERROR_PX else None

    @torch.no_grad()
    def target(self, scene: Scene, fit: Fit, first: int, frames: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The world's latent frames ``first .. first + frames - 1`` of the session along ``fit``: video
        ``[16, frames, h, w]`` (model space), audio ``[8, 20 frames]``, footprint ``[frames, h, w]``."""
        start = first - ENCODE_CONTEXT  # the encoder's stream starts at this latent frame's last video frame
        count = ENCODE_CONTEXT + frames
        video_frames = 1 + 4 * (count - 1)
        times = (4 * start + np.arange(video_frames)) / FPS
        cx, cy = fit.centre(times)
        rendered, coverage = render_with_coverage(scene, cx, cy, self.device)
        latents = self.codec.encode_video((rendered * 2 - 1).unsqueeze(0))  # [1, 16, count, h, w]
        video = ((latents - self.mean) / self.std)[0, :, -frames:]
        footprint = latent_footprint(coverage, count)[-frames:]
        until = (4 * (first + frames) + 8) / FPS
        audio = features_along([(scene, 0.0)], lambda t: fit.centre(t)[1], fit.bounces(until),
                               AUDIO_FRAMES_PER_LATENT * frames, start_frame=AUDIO_FRAMES_PER_LATENT * first)
        return video, audio.to(self.device), footprint


class LongRollout:
    """Runs the stage: ``trainer`` (train.dit.DiTTrainer) owns the optimiser and the modules."""

    def __init__(self, trainer, text_encoder, targets: WorldTargets, *, latent_size: tuple[int, int], block: int = 2,
                 sink: int = 3, window: int = 15, rng: np.random.Generator) -> None:
        self.trainer, self.text_encoder, self.targets = trainer, text_encoder, targets
        self.latent_size = latent_size
        self.block, self.sink, self.window, self.rng = block, sink, window, rng
        self.updates = 0  # learned against the world (the log's every 10th)

    @torch.no_grad()
    def _open(self, captions: list[str]):
        """The engine's own pipeline on the modules being trained, one paged KV session per sample. A rollout keeps
        the text conditioning (embeddings and projected K/V) it started with, as a session does; the updates made
        during it reach its blocks' self-attention at once and its text at the next rollout."""
        from engine.kv_cache import KVCacheManager
        from engine.models.pipeline import CausalWanPipeline

        pipeline = CausalWanPipeline(self.trainer.causal, self.text_encoder, sigmas=list(ENGINE_SIGMAS),
                                     frames_per_block=self.block, sink_frames=self.sink, window_frames=self.window)
        manager = KVCacheManager(pipeline.kv_spec(), len(captions), str(self.trainer.device))
        sessions = []
        for index, caption in enumerate(captions):
            kv = manager.open_session(f"long-{index}")
            sessions.append((kv, pipeline.new_progress(int(self.rng.integers(1 << 31)), caption)))
        return pipeline, sessions

    @torch.no_grad()
    def _generate(self, pipeline, sessions) -> BlockLatents:
        """One block of every session, made exactly as the engine serves it (paged sink + window KV)."""
        made = [pipeline.run_block(kv, progress) for kv, progress in sessions]
        return BlockLatents(torch.cat([b.video for b in made]).float(), torch.cat([b.audio for b in made]).float())

    def _learned(self, session: Session, like: BlockLatents, kv, target_step: int) -> BlockLatents:
        """The engine's steps for the next block up to ``target_step``, only that one with gradients: its x0."""
        history, groups = session.resident(self.sink, self.window)
        g = torch.tensor(groups + [session.groups[-1] + 1] * self.block, device=like.video.device)
        causal = self.trainer.causal
        return self.trainer.learned_block(history, like, kv, target_step,
                                          flow_of=lambda h, x, t, k: resident_flow(causal, h, g, x, t, k))

    def _loss(self, x0: BlockLatents, video: torch.Tensor, audio: torch.Tensor, footprint: torch.Tensor,
              valid: torch.Tensor) -> dict[str, torch.Tensor]:
        """Object-weighted video MSE + audio MSE over the samples whose target could be made."""
        w = valid.float()
        pixel = 1.0 + OBJECT_WEIGHT * footprint  # [B, F, h, w]
        err_v = ((x0.video.float() - video) ** 2).mean(dim=1)  # [B, F, h, w]
        per_v = (err_v * pixel).sum(dim=(1, 2, 3)) / pixel.sum(dim=(1, 2, 3))
        per_a = ((x0.audio.float() - audio) ** 2).mean(dim=(1, 2))
        count = w.sum().clamp_min(1.0)
        video_loss, audio_loss = (per_v * w).sum() / count, (per_a * w).sum() / count
        with torch.no_grad():
            plain = ((err_v.mean(dim=(1, 2, 3))) * w).sum() / count
        return {"loss": video_loss + audio_loss, "video": plain, "weighted": video_loss.detach(), "audio": audio_loss.detach()}

    def run(self, log: LossLog, clock: StageClock, batch: int, *, blocks: int = 24, learn_from: int = 3,
            learn_share: float = 0.5, name: str = "long", hold=None, hold_share: float = 0.0) -> int:
        """Rollouts of ``blocks`` blocks each; after block ``learn_from`` on, with ``learn_share``, one update
        on the next block. ``hold()`` (optional: another stage's losses for one sample, e.g. the few-step
        stage's on clips, whose openings the long rollouts hardly learn) is an update instead with
        ``hold_share``, logged as ``{name}h``. Returns the number of updates."""
        step = rollouts = held = 0
        device = self.trainer.device
        while not clock.expired(step):
            scenes = [random_scene(self.rng) for _ in range(batch)]
            ids = [self.text_encoder.token_ids(s.caption) for s in scenes]
            pipeline, sessions = self._open([s.caption for s in scenes])
            session: Session | None = None
            rollouts += 1
            try:
                for b in range(blocks):
                    if clock.expired(step):
                        break
                    like = self._like(batch, device)
                    if session is not None and b >= learn_from and self.rng.random() < learn_share:
                        if hold is not None and self.rng.random() < hold_share:
                            losses, _ = hold()
                            self.trainer.update(losses["loss"])
                            step, held = step + 1, held + 1
                            if held % 10 == 1:
                                self.trainer._log(log, name + "h", step, losses)
                        else:
                            step += self._update(session, scenes, ids, like, log, name, step, rollouts)
                    new = self._generate(pipeline, sessions)
                    group = 0 if session is None else session.groups[-1] + 1
                    if session is None:
                        session = Session(new.video, new.audio, [group] * self.block)
                    else:
                        session = Session(torch.cat([session.video, new.video], 2), torch.cat([session.audio, new.audio], 2),
                                          session.groups + [group] * self.block)
            finally:
                for kv, _ in sessions:
                    kv.close()
        return step

    def _like(self, batch: int, device) -> BlockLatents:
        h, w = self.latent_size
        return BlockLatents(torch.zeros(batch, 16, self.block, h, w, device=device),
                            torch.zeros(batch, 8, AUDIO_FRAMES_PER_LATENT * self.block, device=device))

    def _update(self, session: Session, scenes: list[Scene], ids, like: BlockLatents, log: LossLog, name: str,
                step: int, rollout: int) -> int:
        if session.length < READ_LATENTS:  # too little of the session to read a path from
            return 0
        paths = self.targets.read_paths(session)
        fits = [self.targets.fit(scene, path) for scene, path in zip(scenes, paths)]
        valid = torch.tensor([f is not None for f in fits], device=like.video.device)
        if not bool(valid.any()):
            return 0
        videos, audios, footprints = [], [], []
        for scene, fit in zip(scenes, fits):
            if fit is None:
                videos.append(like.video[0])
                audios.append(like.audio[0])
                footprints.append(torch.zeros_like(like.video[0, 0]))
                continue
            v, a, f = self.targets.target(scene, fit, session.length, self.block)
            videos.append(v)
            audios.append(a)
            footprints.append(f.float())
        kv = self.trainer.cross_kv(ids)
        target_step = int(self.rng.integers(len(ENGINE_SIGMAS)))
        x0 = self._learned(session, like, kv, target_step)
        losses = self._loss(x0, torch.stack(videos), torch.stack(audios), torch.stack(footprints), valid)
        self.trainer.update(losses["loss"])
        self.updates += 1
        if self.updates % 10 == 1:
            self.trainer._log(log, name, step + 1, losses, latent_frame=float(session.length), valid=float(valid.float().mean()),
                              fit_px=float(np.mean([f.error_px for f in fits if f is not None])), rollout=float(rollout))
        return 1
