"""What every streaming video decoder promises the runner, checked once for each (tiny real models, CPU).

The engine decodes a session block by block with state the session owns (``decoders/video.py``: the Wan
VAE, ``decoders/taehv.py``: TAEHV). Whichever it runs: chunked decode equals one call, bit for bit; the
opening latent frame gives one pixel frame and every later one four; sessions share nothing; release
starts a session over; its state's bytes are what it declares for admission; bad input is refused and
leaves the state alone. What only one of them does is tested in its own file.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan

from decoders.taehv import TINY_TAEHV_CONFIG, TAEHVStreamingDecoder, random_taehv
from decoders.video import WanStreamingDecoder
from engine.models.presets import TINY_VAE_CONFIG

pytestmark = pytest.mark.background  # computes only: runs on the idle core (tests/background_pytest.py)

LATENT_H, LATENT_W = 8, 8  # 64x64 pixels


def _wan(fast_path: bool = True) -> WanStreamingDecoder:
    torch.manual_seed(0)
    return WanStreamingDecoder(AutoencoderKLWan(**TINY_VAE_CONFIG).eval(), fast_path=fast_path)


DECODERS = {
    "wan": _wan,
    "wan-diffusers-path": lambda: _wan(fast_path=False),
    "taehv": lambda: TAEHVStreamingDecoder(random_taehv(seed=0, config=TINY_TAEHV_CONFIG)),
    "taehv-channels-last": lambda: TAEHVStreamingDecoder(random_taehv(seed=0, config=TINY_TAEHV_CONFIG),
                                                         channels_last=True),
}
ENGINE_DECODERS = ("wan", "taehv")  # what the engine builds (the others: the same function, another layout)


def random_latents(frames: int, height: int = LATENT_H, width: int = LATENT_W, seed: int = 1) -> torch.Tensor:
    return torch.randn(1, 16, frames, height, width, generator=torch.Generator().manual_seed(seed))


def decode_in_chunks(decoder, latents: torch.Tensor, split: list[int], session_id: str = "s") -> torch.Tensor:
    state = decoder.new_state(session_id)
    return torch.cat([decoder.decode_chunk(chunk, state) for chunk in latents.split(split, dim=2)], dim=2)


@pytest.fixture(scope="module", params=ENGINE_DECODERS)
def name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def decoder(name):
    return DECODERS[name]()


@pytest.fixture(scope="module")
def seven_frames() -> torch.Tensor:
    return random_latents(7)


@pytest.mark.parametrize("name", DECODERS)
def test_chunked_decode_matches_single_call(name, seven_frames):
    decoder = DECODERS[name]()
    whole = decode_in_chunks(decoder, seven_frames, [7])
    assert whole.shape == (1, 3, 25, 64, 64)
    splits = ([1, 3, 3], [3, 2, 2]) + (([1] * 7,) if name.startswith("taehv") else ())  # frame by frame: cheap there
    for split in splits:
        assert torch.equal(decode_in_chunks(decoder, seven_frames, split), whole), split


def test_first_block_gives_9_frames_and_later_blocks_12(decoder):
    state = decoder.new_state("counts")
    assert not state.started
    counts = [decoder.decode_chunk(random_latents(3, seed=seed), state).shape[2] for seed in range(3)]
    assert counts == [9, 12, 12]
    assert state.started and state.frames_decoded == 9 and state.chunks_decoded == 3
    opening = decoder.new_state("one-frame-opening")  # the split first block: its opening frame alone
    assert decoder.decode_chunk(random_latents(1), opening).shape[2] == 1
    assert decoder.decode_chunk(random_latents(2), opening).shape[2] == 8


def test_interleaved_sessions_match_sessions_alone(decoder):
    latents_a, latents_b = random_latents(7, seed=10), random_latents(7, seed=11)
    alone_a = decode_in_chunks(decoder, latents_a, [1, 3, 3])
    alone_b = decode_in_chunks(decoder, latents_b, [1, 3, 3])
    state_a, state_b = decoder.new_state("a"), decoder.new_state("b")
    parts_a, parts_b = [], []
    for chunk_a, chunk_b in zip(latents_a.split([1, 3, 3], dim=2), latents_b.split([1, 3, 3], dim=2)):
        parts_a.append(decoder.decode_chunk(chunk_a, state_a))
        parts_b.append(decoder.decode_chunk(chunk_b, state_b))
    assert torch.equal(torch.cat(parts_a, dim=2), alone_a)
    assert torch.equal(torch.cat(parts_b, dim=2), alone_b)
    assert not torch.equal(alone_a, alone_b)


def test_release_empties_state_and_restarts_the_stream(decoder, seven_frames):
    state = decoder.new_state("released")
    first = decoder.decode_chunk(seven_frames[:, :, :3], state)
    later = decoder.decode_chunk(seven_frames[:, :, 3:6], state)
    assert state.nbytes() > 0
    decoder.release(state)
    assert state.nbytes() == 0 and not state.started and state.chunks_decoded == 0
    assert torch.equal(decoder.decode_chunk(seven_frames[:, :, :3], state), first)  # as if new
    # The state matters: the same latents decode differently without the session's past.
    fresh = decoder.decode_chunk(seven_frames[:, :, 3:6], decoder.new_state("fresh"))
    assert not torch.equal(fresh[:, :, -9:], later[:, :, -9:])


def test_decoded_frames_are_finite_and_not_constant(decoder):
    frames = decode_in_chunks(decoder, random_latents(2, 18, 32, seed=7), [1, 1])  # 256x144, the preset's size
    assert frames.shape == (1, 3, 5, 144, 256)
    assert torch.isfinite(frames).all()
    assert frames.std().item() > 0.01


@pytest.mark.parametrize("latent_hw", [(8, 8), (6, 10)])
def test_declared_state_bytes_are_what_a_session_holds(decoder, latent_hw):
    height, width = latent_hw[0] * 8, latent_hw[1] * 8
    state = decoder.new_state("declared")
    decoder.decode_chunk(random_latents(2, *latent_hw), state)
    assert decoder.declared_state_bytes(height, width, torch.float32) == state.nbytes()
    assert decoder.declared_state_bytes(height, width, torch.bfloat16) == state.nbytes() // 2
    decoder.decode_chunk(random_latents(3, *latent_hw, seed=5), state)
    assert decoder.declared_state_bytes(height, width, torch.float32) == state.nbytes()  # bounded


def test_to_uint8_maps_minus_one_to_zero_and_one_to_255(decoder):
    frames = torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0, 2.0]).view(1, 1, 6, 1, 1).expand(1, 3, 6, 1, 1)
    pixels = type(decoder).to_uint8(frames)
    assert pixels.shape == (6, 1, 1, 3) and pixels.dtype == np.uint8
    assert pixels[:, 0, 0, 0].tolist() == [0, 64, 128, 191, 255, 255]


def test_bad_inputs_are_refused_and_leave_the_state_alone(name, decoder):
    state = decoder.new_state("errors")
    with pytest.raises(ValueError, match="batch"):
        decoder.decode_chunk(torch.randn(2, 16, 1, LATENT_H, LATENT_W), state)
    with pytest.raises(ValueError, match="shape"):
        decoder.decode_chunk(torch.randn(16, 1, LATENT_H, LATENT_W), state)
    with pytest.raises(ValueError, match="no frames"):
        decoder.decode_chunk(torch.randn(1, 16, 0, LATENT_H, LATENT_W), state)
    with pytest.raises(ValueError, match="channels"):
        decoder.decode_chunk(torch.randn(1, 4, 1, LATENT_H, LATENT_W), state)
    foreign = DECODERS[name]().new_state("foreign")  # the same kind of decoder, another instance
    with pytest.raises(ValueError, match="another decoder"):
        decoder.decode_chunk(random_latents(1), foreign)
    with pytest.raises(ValueError, match="another decoder"):
        decoder.release(foreign)
    with pytest.raises(ValueError, match="session_id"):
        decoder.new_state("")
    with pytest.raises(ValueError, match="multiples of 8"):
        decoder.declared_state_bytes(100, 64, torch.float32)
    assert state.frames_decoded == 0 and state.nbytes() == 0
