"""Training mechanics: the teacher-forced forward is the engine's block forward, the word encoder, the sampler's targets,
the continuation stage's history is the engine's opening context and a continuation round runs."""

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.models.latents import BlockLatents
from engine.models.text_encoder import WordTextEncoder
from tests.engine_helpers import build_small
from train.data import LatentSet
from train.dit import Sampler, _forward, block_flow, history_mask, teacher_forced_flow, text_kv
from world.grammar import VOCABULARY

# Runs on the idle core (tests/background_pytest.py); not the toy rounds, whose stages have budgets in seconds.
computes_only = pytest.mark.background


@computes_only
def test_teacher_forced_forward_gives_each_block_what_the_engine_forward_gives_it_after_its_clean_history():
    _, bundle = build_small(sink_frames=3, window_frames=6)
    causal = bundle.pipeline.transformer
    generator = torch.Generator().manual_seed(0)
    frames, per = 6, causal.audio_tokens_per_frame
    clean = BlockLatents(torch.randn(1, 16, frames, 6, 8, generator=generator), torch.randn(1, 8, frames * per, generator=generator))
    noisy = BlockLatents(torch.randn(1, 16, frames, 6, 8, generator=generator), torch.randn(1, 8, frames * per, generator=generator))
    sigmas = torch.tensor([[1000.0] * 3 + [625.0] * 3])
    kv = text_kv(causal, torch.randn(1, 512, causal.transformer.config.text_dim, generator=generator))
    with torch.no_grad():
        both = teacher_forced_flow(causal, clean, noisy, sigmas, kv)
        first = block_flow(causal, None, BlockLatents(noisy.video[:, :, :3], noisy.audio[:, :, : 3 * per]), 1000.0, kv)
        history = BlockLatents(clean.video[:, :, :3], clean.audio[:, :, : 3 * per])
        second = block_flow(causal, history, BlockLatents(noisy.video[:, :, 3:], noisy.audio[:, :, 3 * per :]), 625.0, kv)
    torch.testing.assert_close(both.video[:, :, :3], first.video, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(both.video[:, :, 3:], second.video, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(both.audio[:, :, 3 * per :], second.audio, atol=1e-5, rtol=1e-4)
    assert _forward is not type(causal).forward  # the undecorated forward: training gets gradients


@computes_only
def test_word_encoder_skips_unknown_words_pads_with_zeros_and_round_trips(tmp_path):
    encoder = WordTextEncoder(VOCABULARY, text_dim=8, text_len=32)
    torch.nn.init.normal_(encoder.positions)
    plain = encoder.encode(["a red circle bouncing on a blue background"])
    chatty = encoder.encode(["Please, show me: a RED circle bouncing on a blue background!"])
    torch.testing.assert_close(plain, chatty)
    assert plain.shape == (1, 32, 8) and plain[0, 8:].abs().sum() == 0 and plain[0, :8].abs().sum() > 0
    assert encoder.encode(["a forest at night"])[0, 1:].abs().sum() == 0  # only "a" is known
    assert encoder.unknown_words("A forest at night, a FOREST!") == ("forest", "at", "night")
    assert encoder.unknown_words("a red circle bouncing on a blue background") == ()
    encoder.save(tmp_path / "text.safetensors")
    torch.testing.assert_close(WordTextEncoder.load(tmp_path / "text.safetensors").encode(["a red circle"]), encoder.encode(["a red circle"]))


@computes_only
def test_sampler_learns_only_blocks_after_a_switch_and_only_the_last_block_of_an_evicted_sample():
    clips, length = 2, 15
    data = LatentSet(
        video=torch.arange(clips * length, dtype=torch.float32).view(clips, 1, length, 1, 1).expand(clips, 16, length, 2, 2).clone(),
        audio=torch.zeros(clips, 8, 20 * length),
        token_ids=[[1], [2]],
        switch=torch.tensor([-1, 6]),
        mean=torch.zeros(16),
        std=torch.ones(16),
    )
    sampler = Sampler(data, 9, np.random.default_rng(0))
    sampler.rng = np.random.default_rng(1)
    for _ in range(20):
        latents, ids, weight = sampler.draw(1, evicted_share=0.0)
        expected = [1, 1, 1] if ids == [[1]] else [0, 0, 1]
        assert weight[0].tolist() == expected
        latents, ids, weight = sampler.draw(1, evicted_share=1.0)
        index = latents.video[0, 0, :, 0, 0] - (0 if ids == [[1]] else length)
        assert index[:3].tolist() == [0, 1, 2] and index[3] >= 6  # the sink, then a later window
        assert weight[0].tolist() == [0, 0, 1]


@computes_only
def test_update_mismatch_compares_two_updates_from_the_same_state_and_restores_it():
    from engine.models.presets import TINY_CODEC_DECODER, TINY_CODEC_ENCODER
    from train.codec import TinyCodec, codec_loss, init_for_training, update_mismatch

    torch.manual_seed(0)
    codec = TinyCodec(TINY_CODEC_ENCODER, TINY_CODEC_DECODER)
    init_for_training(codec)
    params = list(codec.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    video = torch.rand(1, 3, 5, 16, 16) * 2 - 1
    weight = torch.ones(1, 1, 5, 16, 16)

    def step(lr=1e-3):
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=False)
        loss, _ = codec_loss(codec, video, weight, noise=0.0)
        loss.backward()
        optimizer.step()

    step()  # optimiser state exists, as after the warm-up
    before = [p.detach().clone() for p in params]
    assert update_mismatch(params, optimizer, step, step) < 1e-5
    assert update_mismatch(params, optimizer, step, lambda: step(lr=3e-3)) > 0.3
    assert all(torch.equal(p, b) for p, b in zip(params, before))


@computes_only
def test_block_flow_after_a_short_context_is_the_engines_first_block_after_commit_context():
    """An image or clip start commits its latents in groups of 3 from frame 0 (4 frames: 3 + 1); the continuation
    stage's dense forward must give the first block what the engine's paged forward gives it."""
    from engine.kv_cache import KVCacheManager

    _, bundle = build_small(sink_frames=3, window_frames=6)
    pipeline = bundle.pipeline
    causal = pipeline.transformer
    generator = torch.Generator().manual_seed(1)
    per = causal.audio_tokens_per_frame
    _, channels, _, height, width = pipeline.latent_shape
    audio_channels = pipeline.audio_shape[1]
    context = BlockLatents(torch.randn(1, channels, 4, height, width, generator=generator), torch.zeros(1, audio_channels, 4 * per))
    x = BlockLatents(torch.randn(1, channels, 3, height, width, generator=generator),
                     torch.randn(1, audio_channels, 3 * per, generator=generator))
    kv = KVCacheManager(pipeline.kv_spec(), 1, "cpu").open_session("context")
    progress = pipeline.new_progress(0, "a red circle bouncing on a blue background")
    with torch.no_grad():
        pipeline.commit_context(kv, progress, context)
        engine = pipeline.forward_branch(kv, progress, "cond", x, 625.0, stage=False)
        dense = block_flow(causal, context, x, 625.0, text_kv(causal, progress.text["cond"]))
    torch.testing.assert_close(dense.video, engine.video.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dense.audio, engine.audio.float(), atol=1e-4, rtol=1e-4)
    whole = torch.arange(7).repeat_interleave(2) // 3
    assert not torch.equal(history_mask(4, 7, 2, "cpu"), whole.unsqueeze(1) >= whole.unsqueeze(0))  # not 0-2, 3-5, 6
    whole = torch.arange(9).repeat_interleave(2) // 3
    assert torch.equal(history_mask(6, 9, 2, "cpu"), whole.unsqueeze(1) >= whole.unsqueeze(0))


def _toy_round_from_the_shipped_weights(tmp_path, monkeypatch, budget: str) -> Path:
    """``train.run --toy --only dit --round 3 --init`` the shipped weights with ``budget``, on the CPU, without the
    codec's and the DiT's read-back checks (their own code, ~12 s here); the checkpoint's directory."""
    from train import codec, run

    monkeypatch.setattr(codec, "reconstruction_report", lambda *a, **k: ([], None))
    monkeypatch.setattr(codec, "print_report", lambda *a, **k: None)
    monkeypatch.setattr(run, "_sample_check", lambda *a, **k: None)
    ckpt = tmp_path / "ckpt"
    assert run.main([
        "--checkpoint", str(ckpt), "--log", str(tmp_path / "train.log"), "--toy", "--device", "cpu",
        "--only", "dit", "--round", "3", "--init", "engine/models/weights/tiny", "--budget", budget,
    ]) == 0
    return ckpt


def test_a_toy_continuation_round_runs_the_cont_and_long_stages_alone_from_the_shipped_weights(tmp_path, monkeypatch):
    """train.run's flags for the GPU call (--only dit --round 3 --init the shipped weights, only cont_s and long_s), at --toy
    size on the CPU."""
    import json

    ckpt = _toy_round_from_the_shipped_weights(
        tmp_path, monkeypatch,
        "tf_s=0,fewstep_s=0,rollout_s=0,cont_s=60,long_s=60,dit_lr=2e-4,data_clips=2,max_steps=4,cont_mix=0.5,"
        "long_hold_kind=cont",  # the long stage held by continuation steps
    )
    stages = json.loads((ckpt / "state.json").read_text())["stages"]
    assert stages["cont3"] == {"done": True, "steps": 4}
    assert stages["long3"] == {"done": True, "steps": 4}  # rollouts learned against the world (train.long_rollout)
    assert all(stages[name]["steps"] == 0 for name in ("tf3", "fewstep3", "rollout3"))
    assert {p.name for p in ckpt.iterdir()} >= {"transformer.safetensors", "audio_tokens.safetensors", "text_encoder.safetensors"}
    assert not (ckpt / "codec.safetensors").exists()  # the shipped codec and its latent statistics stay
    logged = (tmp_path / "train.log").read_text()
    assert "cont3 step=" in logged and "cont3r step=" in logged  # both kinds of step ran
    assert "long3 step=" in logged and "valid=" in logged and "long3h step=" in logged  # learned against the world, and held


def test_a_round_trained_with_another_spatial_rotary_base_names_it_and_the_fade_checks_overlay_takes_it(tmp_path, monkeypatch):
    """``rope_spatial_theta=20`` (engine.models.rope; not the shipped base): one teacher-forced step from the shipped weights; the checkpoint's
    transformer file says its base, and train.fade's overlay onto the shipped model's bundle rebuilds the tables."""
    from engine.models.trained import rope_spatial_theta
    from train import checks, fade

    ckpt = _toy_round_from_the_shipped_weights(
        tmp_path, monkeypatch, "fewstep_s=0,rollout_s=0,cont_s=0,long_s=0,data_clips=2,max_steps=1,rope_spatial_theta=20"
    )
    assert rope_spatial_theta(ckpt / "transformer.safetensors") == 20.0
    shipped = rope_spatial_theta(Path("engine/models/weights/tiny/transformer.safetensors"))
    bundle = checks.build()
    assert bundle.pipeline.transformer.rope.spatial_theta == shipped != 20.0
    assert fade.overlay(bundle, ckpt) == ["transformer", "audio_tokens", "text_encoder"]
    assert bundle.pipeline.transformer.rope.spatial_theta == 20.0


@computes_only
def test_the_long_rollouts_dense_forward_is_the_engines_after_blocks_of_two_and_keeps_what_the_engine_keeps():
    """train.long_rollout rolls sessions out in the served block length (2): before the window's first eviction its
    dense forward (each frame seeing its own block and the ones before) gives a new block what the engine's paged
    forward gives it; past it, the resident frames are the sink's and the window's, numbered as the engine does."""
    from engine.kv_cache import KVCacheManager
    from train.long_rollout import Session, resident_flow

    _, bundle = build_small(sink_frames=3, window_frames=6, frames_per_block=2)
    pipeline = bundle.pipeline
    causal = pipeline.transformer
    kv = KVCacheManager(pipeline.kv_spec(), 1, "cpu").open_session("long")
    progress = pipeline.new_progress(0, "a red circle bouncing on a blue background")
    with torch.no_grad():
        made = [pipeline.run_block(kv, progress) for _ in range(3)]  # 6 frames: the sink and 3 of the window
        history = BlockLatents(torch.cat([b.video for b in made], 2).float(), torch.cat([b.audio for b in made], 2).float())
        generator = torch.Generator().manual_seed(2)
        x = BlockLatents(torch.randn(made[0].video.shape, generator=generator), torch.randn(made[0].audio.shape, generator=generator))
        engine = pipeline.forward_branch(kv, progress, "cond", x, 625.0, stage=False)
        groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        dense = resident_flow(causal, history, groups, x, 625.0, text_kv(causal, progress.text["cond"]))
    kv.close()
    torch.testing.assert_close(dense.video, engine.video.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dense.audio, engine.audio.float(), atol=1e-4, rtol=1e-4)
    per = history.audio.shape[2] // 6
    frames = torch.arange(14, dtype=torch.float32)
    session = Session(frames.view(1, 1, 14, 1, 1), frames.repeat_interleave(per).view(1, 1, -1), [i // 2 for i in range(14)])
    resident, kept_groups = session.resident(sink=3, window=6)
    assert resident.video.flatten().tolist() == [0, 1, 2, 8, 9, 10, 11, 12, 13]
    assert resident.audio.flatten().tolist() == [f for f in [0, 1, 2, 8, 9, 10, 11, 12, 13] for _ in range(per)]
    assert kept_groups == [0, 0, 1, 4, 4, 5, 5, 6, 6]


@computes_only
def test_the_worlds_continuation_of_a_world_clip_is_the_clips_own_next_block():
    """train.long_rollout.WorldTargets on the shipped codec: a session whose frames are a world clip's (encoded, in
    model space) reads back the clip's path, and the target made from it for the next block is what encoding the
    longer clip gives there (up to the codec's encoder memory), with the object's footprint where the clip has it."""
    from pathlib import Path

    from engine.models.trained import TrainedWeights
    from train.common import build_modules, load_module_file
    from train.data import latent_footprint
    from train.long_rollout import Session, WorldTargets
    from world.clips import make_clip
    from world.grammar import Scene

    weights = Path("engine/models/weights/tiny")
    codec = build_modules("cpu")["codec"]
    assert load_module_file(weights / "codec.safetensors", codec)
    stats = TrainedWeights(weights).latent_stats()
    targets = WorldTargets(codec, torch.tensor(stats["latents_mean"]), torch.tensor(stats["latents_std"]), "cpu")
    scene = Scene("circle", "red", "bouncing", "blue")
    clip = make_clip(scene, seed=1, latent_frames=12)
    with torch.no_grad():
        latents = (codec.encode_video(clip.video.unsqueeze(0)) - targets.mean) / targets.std
    session = Session(latents[:, :, :10], clip.features.unsqueeze(0)[:, :, :200], [i // 2 for i in range(10)])
    (path,) = targets.read_paths(session)
    fit = targets.fit(scene, path)
    assert fit is not None and fit.error_px < 3.0  # the decoded frames' centroids are read to ~1-2 px
    video, audio, footprint = targets.target(scene, fit, first=10, frames=2)
    own = latents[0, :, 10:12]
    relative = float(((video - own) ** 2).mean() / (own**2).mean())
    assert relative < 0.05, relative
    torch.testing.assert_close(audio[:3], clip.features[:3, 200:240])  # the circle's tone, on
    assert float((audio[3] - clip.features[3, 200:240]).abs().max()) < 0.1  # the height, from the fitted path
    expected = latent_footprint(clip.coverage, 12)[10:12]
    assert float((footprint * expected).sum() / expected.sum()) > 0.8
    assert targets.fit(Scene("circle", "red", "still", "blue"), (np.zeros(2), np.zeros(2), np.zeros(2))) is None  # too few frames


@computes_only
def test_the_gate_judges_each_picture_cell_and_recache_and_saves_the_cells_it_ran(capsys, tmp_path):
    """train.gate, the CPU gate of a round's candidate, on the shipped weights (no --weights): a picture on an
    ordinary blue under "bouncing" keeps its object (tests/test_image_to_video.py's bound) and one on pure blue
    does not (31 and 24 of 36 frames, docs/TINY_MODEL.md), `recache` repaints the background; the exit status
    says that one cell failed, and the sheet holds one row a cell: the picture, then five generated frames."""
    from PIL import Image

    from train import gate

    sheet = tmp_path / "pictures.png"
    argv = ["--only", "pictures,recache", "--blues", "everyday,pure", "--motions", "bouncing", "--sheet", str(sheet)]
    assert gate.main(argv) == 1
    lines = capsys.readouterr().out.splitlines()
    pictures = [line for line in lines if line.startswith("pictures")]
    recache = [line for line in lines if line.startswith("recache")]
    assert len(pictures) == 2
    assert "everyday bouncing" in pictures[0] and pictures[0].endswith("PASS")
    assert "pure     bouncing" in pictures[1] and pictures[1].endswith("FAIL")
    assert len(recache) == 3 and all(line.endswith("PASS") for line in recache)
    assert lines[-1] == "some failed"
    with Image.open(sheet) as image:  # two rows (one a cell) of the picture and frames 0, 4, 12, 24, 35
        assert image.size == (256 * (1 + len(gate.SHEET_FRAMES)), 2 * 144)


def _candidate(directory: Path, value: float, theta: str | None = "16.0") -> Path:
    """A candidate's DiT files with a few tensors of one value (the layout train.run writes)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    metadata = {"rope_spatial_theta": theta} if theta is not None else None
    save_file({"blocks.0.attn1.to_q.weight": torch.full((4, 4), value), "blocks.0.ffn.net.0.proj.weight": torch.full((4, 2), value),
               "steps": torch.tensor([3, 4])}, directory / "transformer.safetensors", metadata=metadata)
    save_file({"embedding.weight": torch.full((2, 3), value)}, directory / "text_encoder.safetensors")
    return directory


@computes_only
def test_a_soup_mixes_two_candidates_weight_by_weight_or_only_the_named_tensors_and_refuses_two_rotary_bases(tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from train.soup import main

    a, b = _candidate(tmp_path / "a", 1.0), _candidate(tmp_path / "b", 3.0)
    assert main([str(a), str(b), "--alpha", "0.25", "--out", str(tmp_path / "all")]) == 0
    mixed = load_file(tmp_path / "all" / "transformer.safetensors")
    assert torch.equal(mixed["blocks.0.attn1.to_q.weight"], torch.full((4, 4), 1.5))
    assert torch.equal(mixed["blocks.0.ffn.net.0.proj.weight"], torch.full((4, 2), 1.5))
    assert torch.equal(mixed["steps"], torch.tensor([3, 4]))  # an integer tensor is copied, not averaged
    assert torch.equal(load_file(tmp_path / "all" / "text_encoder.safetensors")["embedding.weight"], torch.full((2, 3), 1.5))
    with safe_open(tmp_path / "all" / "transformer.safetensors", "pt") as handle:
        assert handle.metadata() == {"rope_spatial_theta": "16.0"}  # the engine serves it with A's base

    assert main([str(a), str(b), "--alpha", "1", "--only", "attn1", "--out", str(tmp_path / "attn")]) == 0
    part = load_file(tmp_path / "attn" / "transformer.safetensors")
    assert torch.equal(part["blocks.0.attn1.to_q.weight"], torch.full((4, 4), 3.0))
    assert torch.equal(part["blocks.0.ffn.net.0.proj.weight"], torch.full((4, 2), 1.0))
    assert torch.equal(load_file(tmp_path / "attn" / "text_encoder.safetensors")["embedding.weight"], torch.full((2, 3), 1.0))

    other = _candidate(tmp_path / "wan", 3.0, theta=None)
    assert main([str(a), str(other), "--alpha", "0.5", "--out", str(tmp_path / "bad")]) == 2
    assert "spatial rotary bases differ" in capsys.readouterr().err
    assert main([str(a), str(b), "--alpha", "0.5", "--only", "attn9", "--out", str(tmp_path / "none")]) == 2
    assert "no transformer tensor" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()  # refused before anything is written
    assert main([str(a), str(b), "--alpha", "1.5", "--out", str(tmp_path / "far")]) == 2
