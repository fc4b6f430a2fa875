"""Streaming video encode, the decoders' contract mirrored: chunked == one call, bounded declared state,
normalise == the decoder's denormalise inverted; for the tiny preset's TAEHV-class encoder and the Wan VAE's."""

import pytest
import torch
from diffusers import AutoencoderKLWan

from decoders.taehv import TAEHVStreamingDecoder
from decoders.taehv_encoder import TAEHVEncoderConfig, TAEHVStreamingEncoder, random_taehv_encoder
from decoders.video import WanStreamingDecoder
from decoders.video_encode import WanStreamingEncoder, measure_encoder_bytes_per_pixel
from engine.models.presets import TINY_VAE_CONFIG

pytestmark = pytest.mark.background  # computes only: runs on the idle core (tests/background_pytest.py)

torch.set_num_threads(1)
CHUNKINGS = [(0, 1), (1, 3), (3, 10), (10, 10), (10, 17)]  # a lone first frame, partial groups, an empty call


def _clip(frames: int, height: int, width: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(1, 3, frames, height, width, generator=generator, dtype=torch.float64) * 2 - 1).to(dtype)


def _chunked(encoder, clip: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    state = encoder.new_state("chunked")
    parts, sizes = [], []
    for start, end in CHUNKINGS:
        parts.append(encoder.encode_chunk(clip[:, :, start:end], state))
        sizes.append(state.nbytes())
    return torch.cat(parts, dim=2), sizes


def test_taehv_chunked_encode_equals_one_call_and_encode_video():
    model = random_taehv_encoder(1, TAEHVEncoderConfig(widths=(8, 8, 12, 16)), dtype=torch.float64)
    encoder = TAEHVStreamingEncoder(model)
    clip = _clip(17, 32, 48, torch.float64)
    whole = encoder.encode_chunk(clip, encoder.new_state("whole"))
    chunked, sizes = _chunked(encoder, clip)
    assert whole.shape == (1, 16, 5, 4, 6)
    assert torch.equal(chunked, whole)  # the same group shapes whatever the chunking: bit for bit
    with torch.no_grad():
        reference = model.encode_video(clip)  # every layer on every frame at once
    assert torch.allclose(whole, reference, rtol=0, atol=1e-12)
    # The state is bounded: the memory blocks plus at most 3 waiting frames, as declared.
    declared = encoder.declared_state_bytes(32, 48, torch.float64)
    assert max(sizes) <= declared
    state = encoder.new_state("three-waiting")
    encoder.encode_chunk(clip[:, :, :4], state)  # 1 + 3: three frames wait for their group
    assert state.pending.shape[0] == 3 and state.nbytes() == declared


def test_wan_vae_chunked_encode_equals_its_own_encode():
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**TINY_VAE_CONFIG).eval()
    encoder = WanStreamingEncoder(vae)
    clip = _clip(17, 32, 48)
    with torch.no_grad():
        reference = vae.encode(clip).latent_dist.mode()  # diffusers' one call (its own feature cache)
    chunked, sizes = _chunked(encoder, clip)
    assert chunked.shape == reference.shape == (1, 16, 5, 4, 6)
    assert torch.equal(chunked, reference)
    assert encoder.frames_needed(3, encoder.new_state("fresh")) == 9  # 1 + 4 + 4
    assert max(sizes) <= encoder.declared_state_bytes(32, 48, torch.float32)
    # The shipped constant is what this architecture measures (a config change must update it).
    assert measure_encoder_bytes_per_pixel(vae, 32, 48) == encoder._bytes_per_pixel


@pytest.mark.parametrize("codec", ["taehv", "wan"])
def test_normalize_inverts_the_decoders_denormalize(codec):
    generator = torch.Generator().manual_seed(3)
    latents = torch.randn(1, 16, 2, 3, 4, generator=generator, dtype=torch.float64)
    if codec == "taehv":
        mean = torch.rand(16, generator=generator).tolist()
        std = (torch.rand(16, generator=generator) + 0.1).tolist()
        encoder = TAEHVStreamingEncoder(random_taehv_encoder(0), latents_mean=mean, latents_std=std)
        from decoders.taehv import TINY_TAEHV_CONFIG, random_taehv

        decoder = TAEHVStreamingDecoder(random_taehv(0, TINY_TAEHV_CONFIG), latents_mean=mean, latents_std=std)
    else:
        vae = AutoencoderKLWan(**TINY_VAE_CONFIG)
        encoder, decoder = WanStreamingEncoder(vae), WanStreamingDecoder(vae)
    assert torch.allclose(decoder.denormalize(encoder.normalize(latents)), latents, atol=1e-12)
    assert not torch.allclose(encoder.normalize(latents), latents)


def test_an_encode_state_belongs_to_its_encoder_and_release_restarts_the_stream():
    first = TAEHVStreamingEncoder(random_taehv_encoder(0))
    second = TAEHVStreamingEncoder(random_taehv_encoder(1))
    state = first.new_state("s")
    clip = _clip(5, 16, 16)
    opening = first.encode_chunk(clip, state)
    with pytest.raises(ValueError, match="another encoder"):
        second.encode_chunk(clip, state)
    with pytest.raises(ValueError, match="another size"):
        first.encode_chunk(clip[:, :, :2], state)  # nothing waits yet: accepted
        first.encode_chunk(_clip(1, 24, 16), state)  # two frames wait at 16x16: a 24x16 frame cannot join them
    first.release(state)
    assert state.nbytes() == 0 and not state.started
    assert torch.equal(first.encode_chunk(clip, state), opening)  # a new stream: the same latents as the first
