"""Training mechanics: the teacher-forced forward is the engine's block forward, the word encoder, the sampler's targets."""

import numpy as np
import torch

from engine.models.latents import BlockLatents
from engine.models.text_encoder import WordTextEncoder
from tests.engine_helpers import build_small
from train.data import LatentSet
from train.dit import Sampler, _forward, block_flow, teacher_forced_flow, text_kv
from world.grammar import VOCABULARY


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
