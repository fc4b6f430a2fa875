"""The causal DiT against independent references: diffusers' own forward, whole-sequence attention, dense attention."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

from engine.kv_cache import KVCacheManager
from engine.models.attention import DenseContext, GatheredContext, PagedContext
from engine.models.causal_wan import CausalWanTransformer
from engine.models.latents import BlockLatents
from tests.engine_helpers import SMALL_TRANSFORMER_CONFIG
from engine.models.reference import reference_generate
from engine.models.schedule import model_timesteps, shifted_sigmas
from engine.models.text_encoder import TinyTextEncoder
from tests.engine_helpers import build_small, small_dit_tiny_preset

pytestmark = pytest.mark.background  # computes only: runs on the idle core (tests/background_pytest.py)

LATENT_H, LATENT_W = 6, 8  # 48x64 pixels


def test_schedule_is_the_shift_5_warp_of_the_design():
    sigmas = shifted_sigmas([1000.0, 750.0, 500.0, 250.0], 5.0)
    assert sigmas == pytest.approx([1.0, 0.9375, 0.8333333333, 0.625], abs=1e-9)
    assert model_timesteps(sigmas) == pytest.approx([1000.0, 937.5, 833.3333333, 625.0], abs=1e-6)


def test_causal_forward_matches_diffusers_forward_with_per_token_timesteps():
    torch.manual_seed(0)
    plain = WanTransformer3DModel(**SMALL_TRANSFORMER_CONFIG).eval()
    causal = CausalWanTransformer(copy.deepcopy(plain), latent_height=LATENT_H, latent_width=LATENT_W)
    latents = torch.randn(1, 16, 3, LATENT_H, LATENT_W)
    text = TinyTextEncoder(SMALL_TRANSFORMER_CONFIG["text_dim"]).encode(["a cat on a wall"])
    frame_timesteps = torch.tensor([[0.0, 500.0, 937.5]])
    per_token = frame_timesteps.repeat_interleave(causal.tokens_per_frame, dim=1)

    with torch.no_grad():
        expected = plain(latents, timestep=per_token, encoder_hidden_states=text).sample
        cos, sin = causal.rotary(3)
        # diffusers attends bidirectionally within the clip: no mask, no history.
        context = DenseContext(cos=cos, sin=sin)
        ours = causal(BlockLatents(latents), frame_timesteps, context, causal.project_text(text)[0]).video
    assert (ours - expected).abs().max() < 1e-5


def test_streamed_generation_matches_full_sequence_block_causal_forward():
    """Paged KV, commit passes and all, equals re-running the whole clean history every forward."""
    config, bundle = build_small(sink_frames=3, window_frames=15)
    pipeline = bundle.pipeline
    num_blocks = 5  # 15 frames: the window has not evicted anything yet
    manager = KVCacheManager(pipeline.kv_spec(), 1, "cpu")
    kv = manager.open_session("s")
    progress = pipeline.new_progress(seed=11, prompt="a lighthouse at night")
    streamed = [pipeline.run_block(kv, progress) for _ in range(num_blocks)]

    reference = reference_generate(
        pipeline.transformer,
        pipeline.embed("a lighthouse at night"),
        num_blocks=num_blocks,
        seed=11,
        sigmas=pipeline.sigmas,
        latent_shape=pipeline.latent_shape,
        audio_shape=pipeline.audio_shape,
    )
    assert streamed[0].audio is not None  # the tiny preset carries audio tokens
    for ours, expected in zip(streamed, reference):
        assert ours.max_abs_diff(expected) < 1e-5
    assert streamed[0].video.std() > 0.1 and not torch.allclose(streamed[1].video, streamed[2].video)


def _diffusers_rotate(x, cos, sin):
    """diffusers' Wan rotary formula, written out here so the test does not share the engine's."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.empty_like(x)
    out[..., 0::2] = (x1 * cos[..., 0::2] - x2 * sin[..., 1::2]).to(x.dtype)
    out[..., 1::2] = (x1 * sin[..., 1::2] + x2 * cos[..., 0::2]).to(x.dtype)
    return out


def test_attention_after_eviction_equals_dense_attention_over_expected_frames():
    sink, window, blocks = 3, 6, 6  # 18 frames committed: frames 3..11 were evicted
    # video tokens only: the dense side below uses diffusers' own (image-only) rotary table
    config, bundle = build_small(sink_frames=sink, window_frames=window, audio=False)
    pipeline = bundle.pipeline
    manager = KVCacheManager(pipeline.kv_spec(), 1, "cpu")
    kv = manager.open_session("s")
    progress = pipeline.new_progress(seed=3, prompt="rain")
    frame_kv = {}  # absolute frame index -> [layers, 2, T, H, D] as committed
    tokens = pipeline.transformer.tokens_per_frame
    for block in range(blocks):
        pipeline.run_block(kv, progress)
        staged = kv.staging("cond")  # still holds the block just committed
        for offset in range(3):
            frame_kv[block * 3 + offset] = staged[:, :, offset * tokens : (offset + 1) * tokens].clone()

    expected_frames = list(range(sink)) + list(range(blocks * 3 - window, blocks * 3))
    resident = kv.resident_block_ids("cond")
    assert len(resident) == sink + window == kv.num_resident_blocks("cond")
    storage = manager.block_pool.storage
    for block_id, frame in zip(resident, expected_frames):
        assert torch.equal(storage[:, :, block_id], frame_kv[frame]), f"block {block_id} does not hold frame {frame}"

    transformer = pipeline.transformer
    context_frames = len(expected_frames) + 3
    history_ids, history_frames = kv.history("cond")
    cos, sin = transformer.rotary(context_frames)
    rope = WanRotaryPosEmbed(transformer.head_dim, (1, 2, 2), 1024)
    d_cos, d_sin = rope(torch.zeros(1, 16, context_frames, LATENT_H, LATENT_W))
    workspace = pipeline.context_kv["cond"]
    workspace.invalidate()
    history_tokens = workspace.load(("test",), storage, resident, cos, sin, transformer.kernels.rotate_pairs)
    gathered_context = GatheredContext(cos=cos, sin=sin, context_kv=workspace.buffer, history_tokens=history_tokens)
    torch.manual_seed(5)
    hidden = torch.randn(1, 3 * tokens, transformer.inner_dim)
    for layer in (0, transformer.num_layers - 1):
        attn = transformer.transformer.blocks[layer].attn1
        with torch.no_grad():
            paged = attn(hidden, context=PagedContext(cos=cos, sin=sin, pool=storage, history_ids=history_ids))
            gathered = attn(hidden, context=gathered_context)
            query = attn.norm_q(attn.to_q(hidden)).unflatten(2, (attn.heads, -1))
            key = attn.norm_k(attn.to_k(hidden)).unflatten(2, (attn.heads, -1))
            value = attn.to_v(hidden).unflatten(2, (attn.heads, -1))
            keys = torch.cat([frame_kv[f][layer, 0] for f in expected_frames] + [key[0]]).unsqueeze(0)
            values = torch.cat([frame_kv[f][layer, 1] for f in expected_frames] + [value[0]]).unsqueeze(0)
            query = _diffusers_rotate(query, d_cos[:, -3 * tokens :], d_sin[:, -3 * tokens :])
            keys = _diffusers_rotate(keys, d_cos, d_sin)
            dense = F.scaled_dot_product_attention(query.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2))
            dense = attn.to_out[0](dense.transpose(1, 2).flatten(2, 3))
        assert history_frames == sink + window
        assert (paged - dense).abs().max() < 1e-5
        assert (gathered - dense).abs().max() < 1e-5


def test_session_of_2000_frames_keeps_pool_usage_and_positions_bounded():
    """Hours-long sessions: resident KV stays sink + window and positions stay in the rotary range."""
    # 667 blocks of one denoising step: the bound depends on neither the DiT's size nor its steps, the time does
    with small_dit_tiny_preset():
        config, bundle = build_small(height=16, width=16, sink_frames=3, window_frames=6, timesteps=[1000.0])
    pipeline = bundle.pipeline
    spec = pipeline.kv_spec()
    manager = KVCacheManager(spec, 1, "cpu")
    kv = manager.open_session("long")
    progress = pipeline.new_progress(seed=0, prompt="forever")
    rope = pipeline.transformer.rope
    widest = []
    original = rope.for_frames

    def recording_for_frames(num_frames, device):
        widest.append(num_frames)
        return original(num_frames, device)

    rope.for_frames = recording_for_frames
    blocks = 2001 // 3 + 1
    free_after = []
    for _ in range(blocks):
        clean = pipeline.run_block(kv, progress)
        free_after.append(manager.block_pool.num_free_blocks)
    assert kv.committed_frames("cond") >= 2000
    steady = free_after[spec.resident_frames // 3 :]
    assert set(steady) == {manager.block_pool.num_blocks - spec.resident_frames}
    assert kv.num_resident_blocks("cond") == spec.resident_frames
    assert max(widest) == spec.context_frames <= rope.max_frames
    assert torch.isfinite(clean.video).all() and clean.video.std() > 0.1


def test_audio_tokens_share_the_blocks_context_and_match_the_reference():
    """With audio tokens in every latent frame, paged streaming still equals the whole-sequence forward."""
    from engine.models.audio_tokens import AudioTokenProjections
    from engine.models.pipeline import CausalWanPipeline
    from engine.models.schedule import shifted_sigmas

    torch.manual_seed(1)
    plain = WanTransformer3DModel(**SMALL_TRANSFORMER_CONFIG).eval()
    inner = SMALL_TRANSFORMER_CONFIG["num_attention_heads"] * SMALL_TRANSFORMER_CONFIG["attention_head_dim"]
    audio = AudioTokenProjections(audio_dim=8, inner_dim=inner, tokens_per_frame=20)
    causal = CausalWanTransformer(plain, latent_height=LATENT_H, latent_width=LATENT_W, audio=audio)
    assert causal.tokens_per_frame == 4 * 3 + 20
    encoder = TinyTextEncoder(SMALL_TRANSFORMER_CONFIG["text_dim"])
    pipeline = CausalWanPipeline(
        causal, encoder, sigmas=shifted_sigmas([1000, 750, 500, 250], 5.0), frames_per_block=3,
        sink_frames=3, window_frames=15,
    )
    manager = KVCacheManager(pipeline.kv_spec(), 1, "cpu")
    kv = manager.open_session("av")
    progress = pipeline.new_progress(seed=2, prompt="thunder")
    streamed = [pipeline.run_block(kv, progress) for _ in range(4)]
    reference = reference_generate(
        causal, pipeline.embed("thunder"), num_blocks=4, seed=2, sigmas=pipeline.sigmas,
        latent_shape=pipeline.latent_shape, audio_shape=pipeline.audio_shape,
    )
    for ours, expected in zip(streamed, reference):
        assert ours.audio.shape == (1, 8, 60)
        assert ours.max_abs_diff(expected) < 1e-5
    # audio tokens attend to the video and back: changing the audio noise changes the video
    assert streamed[0].audio.std() > 0.1
    with torch.no_grad():
        cos, sin = causal.rotary(3)
        context = DenseContext(cos=cos, sin=sin)
        text = causal.project_text(pipeline.embed("thunder"))[0]
        base = causal(streamed[0], torch.full((1, 3), 500.0), context, text)
        nudged = BlockLatents(streamed[0].video, streamed[0].audio + 1.0)
        moved = causal(nudged, torch.full((1, 3), 500.0), context, text)
    assert not torch.allclose(base.video, moved.video)
