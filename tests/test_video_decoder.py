"""Streaming video decode over a tiny real diffusers AutoencoderKLWan (CPU, float32)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

from decoders.video import (
    TINY_VAE_STATE_BYTES_PER_PIXEL_FP32,
    StreamingDecodeState,
    WanStreamingDecoder,
    causal_conv3d_as_conv2d,
    measure_bytes_per_pixel,
)
from engine.models.presets import TINY_VAE_CONFIG

Z_DIM = 16
LATENT_H, LATENT_W = 8, 8  # 64x64 pixels: small enough to keep the file fast


def build_tiny_vae(seed: int = 0) -> AutoencoderKLWan:
    torch.manual_seed(seed)
    return AutoencoderKLWan(**TINY_VAE_CONFIG).eval()


def random_latents(frames: int, height: int = LATENT_H, width: int = LATENT_W, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, Z_DIM, frames, height, width, generator=generator)


def decode_in_chunks(decoder: WanStreamingDecoder, latents: torch.Tensor, split: list[int], session_id: str = "s"):
    state = decoder.new_state(session_id)
    chunks = list(latents.split(split, dim=2))
    return torch.cat([decoder.decode_chunk(chunk, state) for chunk in chunks], dim=2)


@pytest.fixture(scope="module")
def vae() -> AutoencoderKLWan:
    return build_tiny_vae()


@pytest.fixture(scope="module")
def eager(vae) -> WanStreamingDecoder:
    return WanStreamingDecoder(vae, fast_path=False)


@pytest.fixture(scope="module")
def fast(vae) -> WanStreamingDecoder:
    return WanStreamingDecoder(vae, fast_path=True)


@pytest.fixture(scope="module")
def seven_frames() -> torch.Tensor:
    return random_latents(7)


# -- exactness ---------------------------------------------------------------


@pytest.mark.parametrize("path", ["eager", "fast"])
def test_chunked_decode_matches_single_call(request, path, seven_frames):
    decoder = request.getfixturevalue(path)
    whole = decode_in_chunks(decoder, seven_frames, [7])
    assert whole.shape == (1, 3, 25, 64, 64)
    for split in ([1, 3, 3], [3, 2, 2]):
        assert torch.equal(decode_in_chunks(decoder, seven_frames, split), whole), split


# The fast path reorders float32 sums, and this random-weight decoder amplifies
# rounding: a 1e-7 relative nudge of the latents moves single output pixels by
# ~1.6e-5, and diffusers' own float32 decode sits up to ~1.1e-5 from a float64
# decode. So the whole-decoder bound is the float32 noise floor (max 5e-5, mean
# 1e-6), the per-conv bound is 1e-5 (test_conv2d_form_matches_causal_conv3d),
# and the fast path must be as close to float64 as diffusers' path is.
FAST_PATH_MAX_ABS = 5e-5
FAST_PATH_MEAN_ABS = 1e-6


def test_streaming_decode_matches_diffusers_decode(vae, eager, fast, seven_frames):
    reference = vae.decode(seven_frames).sample
    streamed = decode_in_chunks(eager, seven_frames, [1, 3, 3])
    assert streamed.shape == reference.shape
    assert (streamed - reference).abs().max().item() <= 1e-5
    fast_difference = (decode_in_chunks(fast, seven_frames, [1, 3, 3]) - reference).abs()
    assert fast_difference.max().item() <= FAST_PATH_MAX_ABS
    assert fast_difference.mean().item() <= FAST_PATH_MEAN_ABS


@pytest.mark.parametrize("latent_hw", [(8, 8), (6, 10)])
def test_fast_path_matches_diffusers_path(vae, eager, fast, latent_hw):
    latents = random_latents(7, *latent_hw, seed=3)
    eager_frames = decode_in_chunks(eager, latents, [1, 3, 3])
    fast_frames = decode_in_chunks(fast, latents, [1, 3, 3])
    difference = (fast_frames - eager_frames).abs()
    assert 0 < difference.max().item() <= FAST_PATH_MAX_ABS  # different kernels, same function
    assert difference.mean().item() <= FAST_PATH_MEAN_ABS

    truth = copy.deepcopy(vae).double().decode(latents.double()).sample
    eager_error = (eager_frames.double() - truth).abs().max().item()
    fast_error = (fast_frames.double() - truth).abs().max().item()
    assert fast_error <= 2 * eager_error


@pytest.mark.parametrize(
    "kernel, padding, stride, frames, cache_frames",
    [
        (3, 1, 1, 1, None),  # a session's opening frame: two causal zero frames
        (3, 1, 1, 1, 1),  # second frame: one cached frame, one zero frame
        (3, 1, 1, 1, 2),
        (3, 1, 1, 4, 2),  # several frames per call (after temporal upsampling)
        ((3, 1, 1), (1, 0, 0), 1, 2, 2),  # WanResample.time_conv
        (1, 0, 1, 4, None),  # shortcut / post_quant_conv
        ((3, 1, 1), 0, (2, 1, 1), 5, None),  # the encoder's strided time_conv
    ],
)
def test_conv2d_form_matches_causal_conv3d(kernel, padding, stride, frames, cache_frames):
    torch.manual_seed(0)
    conv = WanCausalConv3d(6, 5, kernel, stride=stride, padding=padding)
    x = torch.randn(1, 6, frames, 7, 9)
    cache = None if cache_frames is None else torch.randn(1, 6, cache_frames, 7, 9)
    expected = WanCausalConv3d.forward(conv, x, cache)
    actual = causal_conv3d_as_conv2d(conv, x, cache)
    assert actual.shape == expected.shape
    assert (actual - expected).abs().max().item() <= 1e-5


# -- sessions ------------------------------------------------------------------


def test_interleaved_sessions_match_sessions_alone(vae, fast):
    latents_a, latents_b = random_latents(7, seed=10), random_latents(7, seed=11)
    alone_a = decode_in_chunks(fast, latents_a, [1, 3, 3])
    alone_b = decode_in_chunks(fast, latents_b, [1, 3, 3])

    # diffusers' own cache on the module must stay exactly as we leave it.
    module_cache = ["untouched"] * vae._cached_conv_counts["decoder"]
    vae._feat_map = module_cache
    state_a, state_b = fast.new_state("a"), fast.new_state("b")
    parts_a, parts_b = [], []
    for chunk_a, chunk_b in zip(latents_a.split([1, 3, 3], dim=2), latents_b.split([1, 3, 3], dim=2)):
        parts_a.append(fast.decode_chunk(chunk_a, state_a))
        parts_b.append(fast.decode_chunk(chunk_b, state_b))

    assert torch.equal(torch.cat(parts_a, dim=2), alone_a)
    assert torch.equal(torch.cat(parts_b, dim=2), alone_b)
    assert vae._feat_map is module_cache and module_cache == ["untouched"] * len(module_cache)


def test_fast_path_leaves_other_users_of_the_vae_on_diffusers_path(seven_frames):
    vae = build_tiny_vae()
    before = vae.decode(seven_frames).sample
    WanStreamingDecoder(vae, fast_path=True)  # installs its forwards on the shared module
    assert torch.equal(vae.decode(seven_frames).sample, before)


def test_deep_copied_vae_runs_its_own_weights_on_the_fast_path(vae, fast, seven_frames):
    copied = copy.deepcopy(vae)
    with torch.no_grad():
        copied.decoder.conv_out.weight.mul_(0.5)
    original = decode_in_chunks(fast, seven_frames, [7])
    from_copy = decode_in_chunks(WanStreamingDecoder(copied, fast_path=True), seven_frames, [7])
    assert copied.decoder.conv_out.forward.__self__ is copied.decoder.conv_out
    assert not torch.equal(from_copy, original)
    assert torch.equal(decode_in_chunks(fast, seven_frames, [7]), original)


def test_first_block_gives_9_frames_and_later_blocks_12(fast):
    state = fast.new_state("counts")
    assert not state.started
    counts = [fast.decode_chunk(random_latents(3, seed=seed), state).shape[2] for seed in range(3)]
    assert counts == [9, 12, 12]
    assert state.started and state.frames_decoded == 9 and state.chunks_decoded == 3

    opening = fast.new_state("one-frame-opening")
    assert fast.decode_chunk(random_latents(1), opening).shape[2] == 1
    assert fast.decode_chunk(random_latents(2), opening).shape[2] == 8


def test_state_bytes_constant_after_second_latent_frame(fast):
    state = fast.new_state("bounded")
    sizes = []
    for seed in range(10):
        fast.decode_chunk(random_latents(1, seed=seed), state)
        sizes.append(state.nbytes())
    assert 0 < sizes[0] < sizes[1]
    assert sizes[1:] == [sizes[1]] * 9


def test_release_empties_state_and_restarts_the_stream(fast, seven_frames):
    state = fast.new_state("released")
    first = fast.decode_chunk(seven_frames[:, :, :3], state)
    fast.decode_chunk(seven_frames[:, :, 3:], state)
    assert state.nbytes() > 0

    fast.release(state)
    assert state.nbytes() == 0 and not state.started and state.chunks_decoded == 0
    # After release the session starts over: its opening block decodes as if new.
    assert torch.equal(fast.decode_chunk(seven_frames[:, :, :3], state), first)


# -- admission accounting ----------------------------------------------------------


@pytest.mark.parametrize("latent_hw", [(8, 8), (6, 10)])
def test_declared_state_bytes_exact_at_two_resolutions(fast, latent_hw):
    height, width = latent_hw[0] * 8, latent_hw[1] * 8
    state = fast.new_state("declared")
    fast.decode_chunk(random_latents(2, *latent_hw), state)
    assert fast.declared_state_bytes(height, width, torch.float32) == state.nbytes()
    assert fast.declared_state_bytes(height, width, torch.bfloat16) == state.nbytes() // 2


def test_tiny_constant_is_the_measured_value(vae):
    assert measure_bytes_per_pixel(vae) == TINY_VAE_STATE_BYTES_PER_PIXEL_FP32
    assert WanStreamingDecoder(vae).declared_state_bytes(144, 256, torch.float32) == round(
        TINY_VAE_STATE_BYTES_PER_PIXEL_FP32 * 144 * 256
    )


def test_declared_state_bytes_measures_an_unknown_architecture():
    torch.manual_seed(0)
    config = dict(TINY_VAE_CONFIG, base_dim=8)
    decoder = WanStreamingDecoder(AutoencoderKLWan(**config).eval(), fast_path=True)
    state = decoder.new_state("unknown")
    decoder.decode_chunk(random_latents(3), state)
    assert decoder.declared_state_bytes(64, 64, torch.float32) == state.nbytes()


# -- pixels ------------------------------------------------------------------------


def test_decoded_frames_are_finite_and_not_constant(fast):
    frames = decode_in_chunks(fast, random_latents(2, 18, 32, seed=7), [1, 1])  # 256x144, the preset's size
    assert frames.shape == (1, 3, 5, 144, 256)
    assert torch.isfinite(frames).all()
    assert frames.std().item() > 0.01
    assert (frames.abs() < 1).float().mean().item() > 0.9  # not saturated at the clamp
    assert frames[:, :, 1:].sub(frames[:, :, :-1]).abs().mean().item() > 0.01  # and it moves


def test_to_uint8_maps_minus_one_to_zero_and_one_to_255():
    frames = torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0, 2.0]).view(1, 1, 6, 1, 1).expand(1, 3, 6, 1, 1)
    pixels = WanStreamingDecoder.to_uint8(frames)
    assert pixels.shape == (6, 1, 1, 3) and pixels.dtype == np.uint8
    assert pixels[:, 0, 0, 0].tolist() == [0, 64, 128, 191, 255, 255]


def test_denormalize_follows_wan_pipeline(vae, fast):
    latents = random_latents(2)
    mean = torch.tensor(vae.config.latents_mean).view(1, Z_DIM, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, Z_DIM, 1, 1, 1)
    assert torch.allclose(fast.denormalize(latents), latents * std + mean, atol=1e-6)
    assert torch.equal(fast.denormalize(latents), latents / (1.0 / std) + mean)


# -- refusals ----------------------------------------------------------------------


def test_bad_inputs_are_refused(vae, fast):
    state = fast.new_state("errors")
    with pytest.raises(ValueError, match="batch"):
        fast.decode_chunk(torch.randn(2, Z_DIM, 1, LATENT_H, LATENT_W), state)
    with pytest.raises(ValueError, match="shape"):
        fast.decode_chunk(torch.randn(Z_DIM, 1, LATENT_H, LATENT_W), state)
    with pytest.raises(ValueError, match="no frames"):
        fast.decode_chunk(torch.randn(1, Z_DIM, 0, LATENT_H, LATENT_W), state)
    with pytest.raises(ValueError, match="channels"):
        fast.decode_chunk(torch.randn(1, 4, 1, LATENT_H, LATENT_W), state)
    foreign = WanStreamingDecoder(vae).new_state("foreign")
    with pytest.raises(ValueError, match="another decoder"):
        fast.decode_chunk(random_latents(1), foreign)
    with pytest.raises(ValueError, match="another decoder"):
        fast.release(foreign)
    with pytest.raises(ValueError, match="session_id"):
        fast.new_state("")
    with pytest.raises(ValueError, match="multiples of 8"):
        fast.declared_state_bytes(100, 64, torch.float32)
    assert state.frames_decoded == 0 and state.nbytes() == 0  # refusals leave the state alone
    assert isinstance(state, StreamingDecodeState)
