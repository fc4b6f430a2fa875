"""Streaming and tiled audio decode over a tiny real diffusers AutoencoderOobleck (CPU, float32).

GPU tests (marked ``gpu``) check the CUDA tiers against eager; they skip without CUDA.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from diffusers import AutoencoderOobleck
from hypothesis import given, settings
from hypothesis import strategies as st

from decoders.audio import (
    AudioDecodeState,
    AudioStreamingDecoder,
    decoded_samples,
    hop_length,
    measure_receptive_field,
    plan_tiles,
    receptive_field,
    streaming_window_frames,
)
from decoders.audio_graphs import AudioDecodeGraphs
from engine.models.presets import STABLE_AUDIO_SIZED_VAE_CONFIG, TINY_AUDIO_VAE_CONFIG

LATENT_DIM = TINY_AUDIO_VAE_CONFIG["decoder_input_channels"]
HOP = 600
BLOCK_FRAMES = 3 * 12000 // HOP  # one AR block of 3 video latent frames = 3A audio latent frames = 60
TINY_FIELD = (12, 12)  # derived and measured once; the tests below re-derive and re-measure it

# diffusers builds Oobleck with the deprecated torch.nn.utils.weight_norm.
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*weight_norm.*:FutureWarning"),
    pytest.mark.background,  # computes only: runs on the idle core (tests/background_pytest.py)
]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def build_vae(config: dict = TINY_AUDIO_VAE_CONFIG, seed: int = 0) -> AutoencoderOobleck:
    torch.manual_seed(seed)
    return AutoencoderOobleck(**config).eval()


def random_latents(frames: int, seed: int = 1, dim: int = LATENT_DIM) -> torch.Tensor:
    return torch.randn(1, dim, frames, generator=torch.Generator().manual_seed(seed))


def stream(decoder: AudioStreamingDecoder, latents: torch.Tensor, split: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Decode ``latents`` block by block, then flush; the waveform and the samples per call."""
    state = decoder.new_state("s")
    pieces = [decoder.decode_block(block, state) for block in latents.split(split, dim=2)]
    pieces.append(decoder.flush(state))
    return torch.cat(pieces, dim=1), [piece.shape[1] for piece in pieces]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # The CPU is shared; two threads that fight for two busy cores are slower than one.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def vae() -> AutoencoderOobleck:
    return build_vae()


@pytest.fixture(scope="module")
def decoder(vae) -> AudioStreamingDecoder:
    return AudioStreamingDecoder(vae)


@pytest.fixture(scope="module")
def clip() -> torch.Tensor:
    return random_latents(150)


@pytest.fixture(scope="module")
def whole(vae, clip) -> torch.Tensor:
    with torch.inference_mode():
        return vae.decode(clip).sample[0]


# -- streaming exactness -----------------------------------------------------


@pytest.mark.parametrize(
    "split",
    [
        [1] * 150,
        [BLOCK_FRAMES, BLOCK_FRAMES, 30],
        [7, 3, 1, BLOCK_FRAMES, 11, 5, 63],  # blocks shorter than the lookahead included
        [150],
    ],
    ids=["1-frame", "3A-frames", "mixed", "one-block"],
)
def test_streamed_blocks_and_flush_equal_whole_clip_decode(decoder, clip, whole, split):
    streamed, _ = stream(decoder, clip, split)
    assert streamed.shape == whole.shape == (2, 150 * HOP - 24)
    assert (streamed - whole).abs().max().item() <= 1e-5


def test_clip_shorter_than_lookahead_comes_out_at_flush(vae, decoder):
    latents = random_latents(5, seed=3)
    streamed, per_call = stream(decoder, latents, [2, 1, 2])
    assert per_call == [0, 0, 0, 5 * HOP - 24]
    with torch.inference_mode():
        assert (streamed - vae.decode(latents).sample[0]).abs().max().item() <= 1e-5


def test_each_block_emits_up_to_the_lookahead(decoder, clip):
    _, per_call = stream(decoder, clip, [BLOCK_FRAMES, BLOCK_FRAMES, 30])
    right = decoder.right_frames
    assert decoder.lookahead_samples == right * HOP == 7200
    assert per_call == [(BLOCK_FRAMES - right) * HOP, BLOCK_FRAMES * HOP, 30 * HOP, right * HOP - 24]


def test_interleaved_sessions_match_sessions_alone(decoder, whole, clip):
    other = random_latents(150, seed=9)
    states = [decoder.new_state("a"), decoder.new_state("b")]
    outputs = [[], []]
    for block_a, block_b in zip(clip.split(BLOCK_FRAMES, dim=2), other.split(BLOCK_FRAMES, dim=2)):
        outputs[0].append(decoder.decode_block(block_a, states[0]))
        outputs[1].append(decoder.decode_block(block_b, states[1]))
    outputs[0].append(decoder.flush(states[0]))
    outputs[1].append(decoder.flush(states[1]))
    assert (torch.cat(outputs[0], dim=1) - whole).abs().max().item() <= 1e-5
    alone, _ = stream(decoder, other, [BLOCK_FRAMES, BLOCK_FRAMES, 30])
    assert torch.equal(torch.cat(outputs[1], dim=1), alone)


# -- tiling ------------------------------------------------------------------


def test_tiled_decode_of_a_long_clip_equals_whole_clip_decode(vae):
    tile = 40
    latents = random_latents(10 * tile, seed=4)
    graphs = AudioDecodeGraphs(vae, compile_shapes=(), tile_frames=tile)
    tiled = graphs.decode(latents)
    assert graphs.last_mode == "tiled"
    assert len(graphs.last_window_modes) == len(plan_tiles(10 * tile, tile, *TINY_FIELD)) > 10
    assert set(graphs.last_window_modes) == {"eager"}
    with torch.inference_mode():
        reference = vae.decode(latents).sample
    assert tiled.shape == reference.shape
    assert (tiled - reference).abs().max().item() <= 1e-5


def test_streaming_through_graphs_off_cuda_serves_eager_and_matches(vae, clip, whole):
    graphs = AudioDecodeGraphs(vae, tile_frames=0)
    graphs.warmup("cpu")  # a no-op off CUDA
    streamed, _ = stream(AudioStreamingDecoder(vae, graphs=graphs), clip, [BLOCK_FRAMES, BLOCK_FRAMES, 30])
    assert graphs.last_mode == "eager"
    assert (streamed - whole).abs().max().item() <= 1e-5


def test_off_cuda_graphs_decode_eagerly_and_exactly(vae):
    latents = random_latents(30, seed=5)
    graphs = AudioDecodeGraphs(vae)
    out = graphs.decode(latents)
    assert graphs.last_mode == "eager"
    assert graphs.plain_graph_lengths == () and graphs.plain_pool is None
    with torch.inference_mode():
        assert torch.equal(out, vae.decoder(latents))


@settings(max_examples=300, deadline=None)
@given(
    frames=st.integers(1, 400),
    left=st.integers(0, 20),
    right=st.integers(0, 20),
    extra=st.integers(1, 80),
    bucket_offsets=st.lists(st.integers(-30, 60), max_size=4),
)
def test_plan_tiles_emits_every_frame_once_with_full_context(frames, left, right, extra, bucket_offsets):
    tile = left + right + extra
    sizes = [tile + offset for offset in bucket_offsets if tile + offset > 0]
    plan = plan_tiles(frames, tile, left, right, sizes)

    emitted = []
    for start, width, emit_start, emit_end in plan:
        assert 0 <= start and start + width <= frames and width <= tile
        assert start <= emit_start < emit_end <= start + width
        for frame in range(emit_start, emit_end):
            assert frame - start >= left or start == 0
            assert start + width - 1 - frame >= right or start + width == frames
        emitted.extend(range(emit_start, emit_end))
    assert emitted == list(range(frames))

    start, width, emit_start, emit_end = plan[-1]
    assert start + width == frames and emit_end == frames
    if frames <= tile:
        assert plan == [(0, frames, 0, frames)]
    else:
        fitting = [size for size in sizes if left + frames - emit_start <= size <= tile]
        assert width == (min(fitting) if fitting else tile)


def test_plan_tiles_refuses_a_tile_within_the_halo():
    with pytest.raises(ValueError, match="must exceed"):
        plan_tiles(100, 24, 12, 12)
    assert plan_tiles(0, 25, 12, 12) == []


# -- receptive field ---------------------------------------------------------


def test_derived_receptive_field_equals_measured(vae):
    assert receptive_field(vae) == measure_receptive_field(vae) == TINY_FIELD


def test_receptive_field_of_stable_audio_strides():
    # Time structure depends on strides and kernels only, so the full-width
    # model (built on the meta device: no weights) and a narrow one with the
    # same strides must agree, and the narrow one is cheap to measure.
    with torch.device("meta"):
        full = AutoencoderOobleck(**STABLE_AUDIO_SIZED_VAE_CONFIG)
    narrow = build_vae({**STABLE_AUDIO_SIZED_VAE_CONFIG, "encoder_hidden_size": 2, "decoder_channels": 2,
                        "channel_multiples": [1, 1, 2, 2, 2], "decoder_input_channels": 4})
    assert hop_length(full) == 1500
    assert receptive_field(full) == receptive_field(narrow) == measure_receptive_field(narrow) == (9, 9)


@pytest.mark.parametrize("side", ["left", "right"])
def test_receptive_field_is_tight(vae, side):
    left, right = receptive_field(vae)
    frames, perturbed = 61, 30
    latents = random_latents(frames, seed=6)
    moved = latents.clone()
    moved[:, :, perturbed] += 1.0
    with torch.inference_mode():
        base, changed = vae.decoder(latents)[0], vae.decoder(moved)[0]

    def frame_changed(frame: int) -> bool:
        window = slice(frame * HOP, (frame + 1) * HOP)
        return not torch.equal(base[:, window], changed[:, window])

    # Frame k reads frame k - left as history and frame k + right as lookahead.
    reach = left if side == "left" else -right
    step = 1 if side == "left" else -1
    assert frame_changed(perturbed + reach)
    assert not frame_changed(perturbed + reach + step)


def test_decoded_length_accounts_for_odd_stride_crop(vae):
    for frames in (1, 7, 60):
        with torch.inference_mode():
            assert vae.decoder(random_latents(frames)).shape[2] == decoded_samples(vae, frames) == frames * HOP - 24


def test_streaming_window_frames_is_block_plus_halo(vae):
    assert streaming_window_frames(vae, BLOCK_FRAMES) == BLOCK_FRAMES + sum(TINY_FIELD)


# -- state ---------------------------------------------------------------------


def test_state_bytes_are_the_declared_history_and_release_frees_them(decoder, clip):
    state = decoder.new_state("bytes")
    assert state.nbytes() == 0
    for block in clip.split(BLOCK_FRAMES, dim=2)[:2]:
        decoder.decode_block(block, state)
        assert state.nbytes() == decoder.declared_state_bytes(torch.float32) == sum(TINY_FIELD) * LATENT_DIM * 4
    assert decoder.declared_state_bytes(torch.bfloat16) == sum(TINY_FIELD) * LATENT_DIM * 2
    decoder.release(state)
    assert state.nbytes() == 0 and state.history is None and state.frames_received == 0


def test_flush_ends_the_stream_and_release_restarts_it(decoder, clip, whole):
    state = decoder.new_state("restart")
    decoder.decode_block(clip[:, :, :20], state)
    decoder.flush(state)
    assert state.nbytes() == 0
    with pytest.raises(ValueError, match="flushed"):
        decoder.decode_block(clip[:, :, :20], state)
    decoder.release(state)
    restarted = torch.cat([decoder.decode_block(clip, state), decoder.flush(state)], dim=1)
    assert (restarted - whole).abs().max().item() <= 1e-5


# -- bad inputs ----------------------------------------------------------------


def test_bad_inputs_are_refused_with_clear_errors(vae, decoder):
    state = decoder.new_state("bad")
    cases = [
        (torch.zeros(2, LATENT_DIM, 4), "batch must be 1"),
        (torch.zeros(1, LATENT_DIM + 1, 4), "latent dim"),
        (torch.zeros(1, LATENT_DIM, 0), "no frames"),
        (torch.zeros(LATENT_DIM, 4), r"\[1, 8, frames\]"),
        (torch.zeros(1, LATENT_DIM, 4, dtype=torch.int64), "floating point"),
    ]
    graphs = AudioDecodeGraphs(vae)
    for latents, message in cases:
        with pytest.raises(ValueError, match=message):
            decoder.decode_block(latents, state)
        with pytest.raises(ValueError, match=message):
            graphs.decode(latents)
    assert state.frames_received == 0
    with pytest.raises(ValueError, match="another decoder"):
        AudioStreamingDecoder(vae).decode_block(random_latents(3), state)
    with pytest.raises(ValueError, match="AudioDecodeState"):
        decoder.flush(object())
    with pytest.raises(ValueError, match="session_id"):
        decoder.new_state("")
    with pytest.raises(ValueError, match="must exceed"):
        AudioDecodeGraphs(vae, tile_frames=24)
    with pytest.raises(ValueError, match="max_graphs"):
        AudioDecodeGraphs(vae, max_graphs=0)
    with pytest.raises(ValueError, match="another VAE"):
        AudioStreamingDecoder(build_vae(), graphs=graphs)
    assert isinstance(state, AudioDecodeState)


# -- CUDA tiers ------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_vae():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.backends.cudnn.allow_tf32 = False
    return build_vae().cuda()


@pytest.mark.gpu
@needs_cuda
def test_plain_graph_is_bit_identical_to_eager(cuda_vae):
    graphs = AudioDecodeGraphs(cuda_vae, compile_shapes=(), tile_frames=0)
    for frames in (17, 84, 17):
        latents = random_latents(frames, seed=frames).cuda()
        out = graphs.decode(latents)
        assert graphs.last_mode == "graph"
        with torch.inference_mode():
            assert torch.equal(out, cuda_vae.decoder(latents))
    assert graphs.plain_graph_lengths == (17, 84)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_buckets_are_close_to_eager(dtype):
    vae = build_vae().cuda().to(dtype)
    window = streaming_window_frames(vae, BLOCK_FRAMES)
    graphs = AudioDecodeGraphs(vae, compile_shapes=(window,), tile_frames=0)
    graphs.warmup("cuda")
    assert graphs.compile_errors == {}
    latents = random_latents(window, seed=11).cuda().to(dtype)
    out = graphs.decode(latents)
    assert graphs.last_mode == "compiled"
    with torch.inference_mode():
        reference = vae.decoder(latents)
    if dtype == torch.float32:
        assert (out - reference).abs().max().item() <= 1e-4
    else:
        assert ((out.float() - reference.float()).norm() / reference.float().norm()).item() <= 2e-2
    # A shorter window is padded into the bucket only where its tail is dropped.
    graphs.decode(latents[:, :, :50], tail_is_clip_end=False)
    assert graphs.last_mode == "compiled"
    graphs.decode(latents[:, :, :50])
    assert graphs.last_mode == "graph"


@pytest.mark.gpu
@needs_cuda
def test_plain_graphs_retire_together_at_max_graphs(cuda_vae):
    graphs = AudioDecodeGraphs(cuda_vae, compile_shapes=(), tile_frames=0, max_graphs=2)
    for frames in (10, 11):
        graphs.decode(random_latents(frames).cuda())
    old_pool = graphs.plain_pool
    old_buffers = [weakref.ref(entry.static_samples) for entry in graphs.plain_graphs]
    latents = random_latents(12).cuda()
    out = graphs.decode(latents)
    assert graphs.plain_graph_lengths == (12,) and graphs.retired_generations == 1
    assert graphs.plain_pool is not None and graphs.plain_pool != old_pool
    assert all(buffer() is None for buffer in old_buffers)  # no old graph survives
    with torch.inference_mode():
        assert torch.equal(out, cuda_vae.decoder(latents))
        again = random_latents(10, seed=2).cuda()
        assert torch.equal(graphs.decode(again), cuda_vae.decoder(again))
    assert graphs.plain_graph_lengths == (12, 10)


@pytest.mark.gpu
@needs_cuda
def test_streaming_through_cuda_graphs_equals_whole_clip_decode(cuda_vae):
    latents = random_latents(150, seed=12).cuda()
    graphs = AudioDecodeGraphs(cuda_vae, compile_shapes=(), tile_frames=0)
    streamed, _ = stream(AudioStreamingDecoder(cuda_vae, graphs=graphs), latents, [BLOCK_FRAMES, BLOCK_FRAMES, 30])
    with torch.inference_mode():
        reference = cuda_vae.decode(latents).sample[0]
    assert (streamed - reference).abs().max().item() <= 1e-5


@pytest.mark.gpu
@needs_cuda
def test_decode_inside_an_outer_capture_runs_eager(cuda_vae):
    graphs = AudioDecodeGraphs(cuda_vae, compile_shapes=(), tile_frames=0)
    latents = random_latents(20).cuda()
    with torch.inference_mode():
        cuda_vae.decoder(latents)  # warm outside the capture
        outer = torch.cuda.CUDAGraph()
        with torch.cuda.graph(outer):
            graphs.decode(latents)
    assert graphs.last_mode == "eager" and graphs.plain_graph_lengths == ()
