"""Streaming video decode over a tiny real diffusers AutoencoderKLWan (CPU, float32): what only the Wan decoder
does (the contract every decoder keeps is tests/test_decoder_contract.py)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, WanResample

from decoders.video import (
    TINY_VAE_STATE_BYTES_PER_PIXEL_FP32,
    WanStreamingDecoder,
    _decode_one_frame,
    _install_steady_resample,
    causal_conv3d_as_conv2d,
    measure_bytes_per_pixel,
)
from engine.models.presets import TINY_VAE_CONFIG

pytestmark = pytest.mark.background  # computes only: runs on the idle core (tests/background_pytest.py)

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


def test_the_modules_own_decode_cache_is_never_touched(vae, fast, seven_frames):
    """diffusers' cache on the module (``_feat_map``) stays exactly as we leave it: the session owns its own."""
    module_cache = ["untouched"] * vae._cached_conv_counts["decoder"]
    vae._feat_map = module_cache
    decode_in_chunks(fast, seven_frames, [1, 3, 3])
    assert vae._feat_map is module_cache and module_cache == ["untouched"] * len(module_cache)


def test_fast_path_leaves_other_users_of_the_vae_on_diffusers_path(seven_frames):
    vae = build_tiny_vae()
    before = vae.decode(seven_frames).sample
    WanStreamingDecoder(vae, fast_path=True)  # installs its forwards on the shared module
    assert torch.equal(vae.decode(seven_frames).sample, before)


def test_steady_resample_forward_equals_diffusers_bit_for_bit(vae, eager, seven_frames):
    """The temporal upsample taken without diffusers' ``== "Rep"`` test computes what diffusers' forward does."""
    patched = copy.deepcopy(vae)
    assert _install_steady_resample(patched.decoder) == 2  # the tiny VAE's two temporal upsamples
    for split in ([1, 3, 3], [1, 1, 1, 2, 2]):
        assert torch.equal(decode_in_chunks(WanStreamingDecoder(patched, fast_path=False), seven_frames, split),
                           decode_in_chunks(eager, seven_frames, split))


def test_steady_frames_never_compare_a_cached_tensor_with_a_string(vae, seven_frames, monkeypatch):
    """Once every cache slot is a tensor, diffusers' resample forward (whose tensor-vs-"Rep" test split the
    compiled decode into 14 graphs on torch 2.11) is not reached, and the compiled function is one graph."""
    patched = copy.deepcopy(vae)
    _install_steady_resample(patched.decoder)
    decoder = WanStreamingDecoder(patched, fast_path=False)
    state = decoder.new_state("steady")
    decoder.decode_chunk(seven_frames[:, :, :2], state)  # the opening frames fill every slot
    assert not any(isinstance(slot, str) for slot in state.feat_map)  # SteadyStateDecode's test

    diffusers_forward = WanResample.forward

    def watched_forward(self, *args, **kwargs):
        if self.mode == "upsample3d":
            raise AssertionError("diffusers' temporal upsample reached on a steady frame")
        return diffusers_forward(self, *args, **kwargs)

    monkeypatch.setattr(WanResample, "forward", watched_forward)
    frame = patched.post_quant_conv(seven_frames[:, :, 2:3])
    with torch.no_grad():
        out, cache = _decode_one_frame(patched.decoder, frame, list(state.feat_map))
        assert out.shape[2] == 4 and len(cache) == len(state.feat_map)
        explained = torch._dynamo.explain(functools.partial(_decode_one_frame, patched.decoder))(
            frame, list(state.feat_map))
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_deep_copied_vae_runs_its_own_weights_on_the_fast_path(vae, fast, seven_frames):
    copied = copy.deepcopy(vae)
    with torch.no_grad():
        copied.decoder.conv_out.weight.mul_(0.5)
    original = decode_in_chunks(fast, seven_frames, [7])
    from_copy = decode_in_chunks(WanStreamingDecoder(copied, fast_path=True), seven_frames, [7])
    assert copied.decoder.conv_out.forward.__self__ is copied.decoder.conv_out
    assert not torch.equal(from_copy, original)
    assert torch.equal(decode_in_chunks(fast, seven_frames, [7]), original)


def test_state_bytes_constant_after_second_latent_frame(fast):
    state = fast.new_state("bounded")
    sizes = []
    for seed in range(10):
        fast.decode_chunk(random_latents(1, seed=seed), state)
        sizes.append(state.nbytes())
    assert 0 < sizes[0] < sizes[1]
    assert sizes[1:] == [sizes[1]] * 9


# -- admission accounting ----------------------------------------------------------


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


def test_decoded_frames_are_not_saturated_and_move(fast):
    frames = decode_in_chunks(fast, random_latents(2, 18, 32, seed=7), [1, 1])  # 256x144, the preset's size
    assert (frames.abs() < 1).float().mean().item() > 0.9  # not saturated at the clamp
    assert frames[:, :, 1:].sub(frames[:, :, :-1]).abs().mean().item() > 0.01  # and it moves


def test_denormalize_follows_wan_pipeline(vae, fast):
    latents = random_latents(2)
    mean = torch.tensor(vae.config.latents_mean).view(1, Z_DIM, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, Z_DIM, 1, 1, 1)
    assert torch.allclose(fast.denormalize(latents), latents * std + mean, atol=1e-6)
    assert torch.equal(fast.denormalize(latents), latents / (1.0 / std) + mean)
