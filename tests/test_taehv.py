"""Streaming TAEHV decode over tiny real decoders (CPU), and loading its weights from local files."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from decoders.taehv import (
    TINY_TAEHV_CONFIG,
    MemoryBlock,
    TAEHVConfig,
    TAEHVDecoder,
    TAEHVStreamingDecoder,
    TAEHVWeightsError,
    TemporalGrow,
    find_taehv_weights,
    load_taehv,
    random_taehv,
    taehv_decoder_from_model_dir,
)

pytestmark = pytest.mark.background  # computes only: runs on the idle core (tests/background_pytest.py)

LATENT_H, LATENT_W = 8, 8  # 64x64 pixels


def random_latents(frames: int, height: int = LATENT_H, width: int = LATENT_W, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, 16, frames, height, width, generator=generator)


def decode_in_chunks(decoder: TAEHVStreamingDecoder, latents: torch.Tensor, split: list[int], session_id: str = "s"):
    state = decoder.new_state(session_id)
    return torch.cat([decoder.decode_chunk(chunk, state) for chunk in latents.split(split, dim=2)], dim=2)


def decode_whole_clip_in_parallel(model: TAEHVDecoder, latents: torch.Tensor) -> torch.Tensor:
    """TAEHV's whole-clip decode, written independently of the streaming path.

    Every layer runs on all frames at once; a memory block's "past" is its input shifted one frame
    later in time (zeros first); then the first frames_per_latent - 1 frames are dropped. Returns
    ``[1, 3, T', H, W]`` in ``[-1, 1]``.
    """
    x = latents[0].permute(1, 0, 2, 3)  # [T, C, h, w]
    for layer in model.decoder:
        if isinstance(layer, MemoryBlock):
            past = torch.cat([torch.zeros_like(x[:1]), x[:-1]])
            x = layer(x, past)
        elif isinstance(layer, TemporalGrow):
            grown = layer.conv(x)  # [T, s*C, H, W] -> [T*s, C, H, W], group g is frame g
            x = grown.reshape(x.shape[0] * layer.stride, x.shape[1], *x.shape[2:])
        else:
            x = layer(x)
    frames = x.clamp(0, 1)[model.config.frames_per_latent - 1 :]
    return (frames * 2 - 1).permute(1, 0, 2, 3).unsqueeze(0)


@pytest.fixture(scope="module")
def model() -> TAEHVDecoder:
    return random_taehv(seed=0, config=TINY_TAEHV_CONFIG)


@pytest.fixture(scope="module")
def decoder(model) -> TAEHVStreamingDecoder:
    return TAEHVStreamingDecoder(model)


@pytest.fixture(scope="module")
def seven_frames() -> torch.Tensor:
    return random_latents(7)


# -- exactness -------------------------------------------------------------------


def test_streaming_decode_matches_whole_clip_parallel_decode(seven_frames):
    model64 = random_taehv(seed=3, config=TINY_TAEHV_CONFIG, dtype=torch.float64)
    latents = seven_frames.double() * 2  # reach the soft clamp's curved part
    streamed = decode_in_chunks(TAEHVStreamingDecoder(model64), latents, [1, 3, 3])
    with torch.no_grad():
        reference = decode_whole_clip_in_parallel(model64, latents)
    assert streamed.shape == reference.shape == (1, 3, 25, 64, 64)
    assert (streamed - reference).abs().max().item() <= 1e-12


def test_channels_last_is_the_same_function(model, seven_frames):
    plain = decode_in_chunks(TAEHVStreamingDecoder(model, channels_last=False), seven_frames, [1, 3, 3])
    nhwc = decode_in_chunks(TAEHVStreamingDecoder(model, channels_last=True), seven_frames, [1, 3, 3])
    assert (plain - nhwc).abs().max().item() <= 1e-5


# -- what only TAEHV does -------------------------------------------------------------------------
# (the contract every streaming decoder keeps is tests/test_decoder_contract.py)


def test_nothing_per_stream_lives_on_the_module(decoder, seven_frames):
    decode_in_chunks(decoder, seven_frames, [1, 3, 3])
    assert not [name for name, _ in decoder.model.named_buffers()]


def test_decoded_frames_stay_in_range(decoder):
    frames = decode_in_chunks(decoder, random_latents(2, 18, 32, seed=7) * 3, [1, 1])  # 256x144
    assert frames.min().item() >= -1.0 and frames.max().item() <= 1.0


def test_wan_widths_declare_84_values_per_pixel_and_match_measurement():
    wan = TAEHVStreamingDecoder(random_taehv(seed=0))
    state = wan.new_state("wan-widths")
    wan.decode_chunk(random_latents(2, 2, 4), state)  # 16x32 pixels: the full-width decoder, briefly
    assert wan.declared_state_bytes(16, 32, torch.float32) == state.nbytes() == 84 * 16 * 32 * 4
    assert wan.declared_state_bytes(480, 832, torch.bfloat16) == 84 * 480 * 832 * 2  # 64.0 MiB


# -- weights ---------------------------------------------------------------------------


def test_default_config_has_the_published_decoder_layout():
    shapes = {key: tuple(value.shape) for key, value in TAEHVDecoder().state_dict().items()}
    # Keys and shapes of the published taew2_1 decoder (TAEHV's layer list at widths 256/128/64/64).
    assert shapes["decoder.1.weight"] == (256, 16, 3, 3)
    assert shapes["decoder.3.conv.0.weight"] == (256, 512, 3, 3)
    assert shapes["decoder.5.conv.4.bias"] == (256,)
    assert shapes["decoder.7.conv.weight"] == (256, 256, 1, 1)
    assert shapes["decoder.8.weight"] == (128, 256, 3, 3) and "decoder.8.bias" not in shapes
    assert shapes["decoder.13.conv.weight"] == (256, 128, 1, 1)
    assert shapes["decoder.17.conv.2.weight"] == (64, 64, 3, 3)
    assert shapes["decoder.19.conv.weight"] == (128, 64, 1, 1)
    assert shapes["decoder.22.weight"] == (3, 64, 3, 3)
    assert len(shapes) == 64 and not any(".skip." in key for key in shapes)


@pytest.mark.parametrize("suffix", [".pth", ".safetensors", "legacy.pth"])
def test_saved_state_dict_round_trips_through_load_taehv(tmp_path, model, decoder, seven_frames, suffix):
    """A .pth is memory-mapped (the zip format), a legacy (pre-zip) .pth read whole: the same weights either way."""
    path = tmp_path / f"taew2_1{suffix}"
    state_dict = {key: value.contiguous() for key, value in model.state_dict().items()}
    if suffix == ".safetensors":
        save_file(state_dict, str(path))
    else:
        torch.save(state_dict, path, _use_new_zipfile_serialization=suffix == ".pth")
    loaded = load_taehv(path, "cpu", torch.float32, config=TINY_TAEHV_CONFIG)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    expected = decode_in_chunks(decoder, seven_frames, [1, 3, 3])
    assert torch.equal(decode_in_chunks(TAEHVStreamingDecoder(loaded), seven_frames, [1, 3, 3]), expected)


def test_published_file_with_encoder_half_loads_and_finds_in_model_dir(tmp_path, model):
    folder = tmp_path / "taehv"
    folder.mkdir()
    state_dict = dict(model.state_dict())
    state_dict["encoder.0.weight"] = torch.zeros(64, 3, 3, 3)  # the published files carry the encoder too
    torch.save(state_dict, folder / "taew2_1.pth")
    path = find_taehv_weights(tmp_path)
    assert path == folder / "taew2_1.pth"
    loaded = load_taehv(path, config=TINY_TAEHV_CONFIG)
    assert torch.equal(loaded.state_dict()["decoder.1.weight"], model.state_dict()["decoder.1.weight"])

    with pytest.raises(TAEHVWeightsError, match="no TAEHV weights"):
        find_taehv_weights(tmp_path / "elsewhere")
    # The published width from a model directory: what the engine builds when TAEHV is chosen.
    torch.save(random_taehv(seed=1).state_dict(), folder / "taew2_1.pth")
    wan_width = taehv_decoder_from_model_dir(tmp_path, "cpu", torch.float32)
    assert wan_width.model.config == TAEHVConfig() and wan_width.dtype == torch.float32


def test_grow_weights_of_a_larger_stride_keep_their_last_frame(tmp_path, model):
    state_dict = dict(model.state_dict())
    key = "decoder.7.conv.weight"  # stride 1 in the config
    last_frame = state_dict[key]
    state_dict[key] = torch.cat([torch.full_like(last_frame, 7.0), last_frame])  # trained at stride 2
    torch.save(state_dict, tmp_path / "strided.pth")
    loaded = load_taehv(tmp_path / "strided.pth", config=TINY_TAEHV_CONFIG)
    assert torch.equal(loaded.state_dict()[key], last_frame)


def test_file_with_a_wrong_key_is_refused_naming_the_file_and_key(tmp_path, model):
    state_dict = dict(model.state_dict())
    state_dict["decoder.3.conv.9.weight"] = state_dict.pop("decoder.3.conv.0.weight")
    path = tmp_path / "renamed.pth"
    torch.save(state_dict, path)
    with pytest.raises(TAEHVWeightsError) as refused:
        load_taehv(path, config=TINY_TAEHV_CONFIG)
    message = str(refused.value)
    assert str(path) in message and "\n" not in message
    assert "1 missing key(s): decoder.3.conv.0.weight" in message
    assert "1 unknown key(s): decoder.3.conv.9.weight" in message


def test_weights_of_other_widths_or_types_are_refused(tmp_path, model):
    # The full-width Wan2.1 decoder's file does not load into the tiny config, and says why.
    with pytest.raises(TAEHVWeightsError, match=r"decoder\.1\.weight \(8, 16, 3, 3\) \(expected \(256, 16, 3, 3\)\)"):
        path = tmp_path / "tiny.pth"
        torch.save(model.state_dict(), path)
        load_taehv(path)
    state_dict = dict(model.state_dict(), **{"decoder.1.bias": torch.zeros(8, dtype=torch.int32)})
    torch.save(state_dict, tmp_path / "ints.pth")
    with pytest.raises(TAEHVWeightsError, match="non-float"):
        load_taehv(tmp_path / "ints.pth", config=TINY_TAEHV_CONFIG)
    torch.save({"decoder": model.state_dict(), "step": 3}, tmp_path / "nested.pth")
    with pytest.raises(TAEHVWeightsError, match="flat state dict"):
        load_taehv(tmp_path / "nested.pth", config=TINY_TAEHV_CONFIG)
    with pytest.raises(TAEHVWeightsError, match="no such file"):
        load_taehv(tmp_path / "absent.pth")
    (tmp_path / "weights.npz").write_bytes(b"x")
    with pytest.raises(TAEHVWeightsError, match="unknown file type .npz"):
        load_taehv(tmp_path / "weights.npz")
    (tmp_path / "broken.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(TAEHVWeightsError, match="broken.safetensors: cannot be read"):
        load_taehv(tmp_path / "broken.safetensors")


def test_pickle_with_objects_is_refused_by_weights_only_load(tmp_path):
    path = tmp_path / "objects.pth"
    torch.save({"decoder.1.weight": torch.zeros(1), "config": TAEHVConfig()}, path)
    with pytest.raises(TAEHVWeightsError, match=r"objects\.pth: cannot be read with torch\.load\(weights_only=True\)"):
        load_taehv(path)


def test_random_weights_are_seeded_and_leave_the_global_rng_alone():
    before = torch.get_rng_state()
    first, second = random_taehv(seed=4, config=TINY_TAEHV_CONFIG), random_taehv(seed=4, config=TINY_TAEHV_CONFIG)
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    other = random_taehv(seed=5, config=TINY_TAEHV_CONFIG)
    assert not torch.equal(first.state_dict()["decoder.1.weight"], other.state_dict()["decoder.1.weight"])


# -- pixels and refusals ----------------------------------------------------------------


def test_denormalize_is_the_identity(decoder):
    latents = random_latents(2)
    assert decoder.denormalize(latents) is latents  # TAEHV decodes model-space latents as they are


def test_configs_it_cannot_stream_are_refused():
    preview = TAEHVConfig(widths=(8, 8, 4, 4), time_upscale=(False, False, True))
    with pytest.raises(ValueError, match="needs 4x and 8x"):
        TAEHVStreamingDecoder(random_taehv(config=preview))
    with pytest.raises(ValueError, match="widths"):
        TAEHVConfig(widths=(8, 8, 4))
    with pytest.raises(TypeError, match="TAEHVDecoder"):
        TAEHVStreamingDecoder(torch.nn.Conv2d(1, 1, 1))


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("ARSTREAM_SLOW_TESTS"), reason="inductor compile: ~70 s on the shared CPU")
def test_compiled_frames_match_eager_and_keep_chunking_exact(model, seven_frames):
    """torch.compile of the per-frame function: same function, same exactness (``ARSTREAM_SLOW_TESTS=1`` runs it)."""
    eager = decode_in_chunks(TAEHVStreamingDecoder(model), seven_frames, [1, 3, 3])
    compiled = TAEHVStreamingDecoder(model, compile_frames=True)
    whole = decode_in_chunks(compiled, seven_frames, [7])
    assert not compiled.compile_failed
    assert (whole - eager).abs().max().item() <= 1e-5
    assert torch.equal(decode_in_chunks(compiled, seven_frames, [1, 3, 3]), whole)


def test_engine_streams_through_taehv_when_configured():
    """video_decoder="taehv" swaps the decoder and nothing else: same frame counts, decoder state per session."""
    from engine.plan import OpenSession, SessionWork, StepPlan
    from tests.engine_helpers import small_runner

    runner = small_runner(video_decoder="taehv", audio=False)
    assert isinstance(runner.decoder, TAEHVStreamingDecoder)
    open_request = OpenSession(seed=1, prompt="a fox", negative_prompt="")
    counts = []
    for index in range(2):
        result = runner.execute(StepPlan(work=[SessionWork("s", open=open_request if index == 0 else None, run=True)]))
        assert not result.failures
        counts.append(result.outputs[0].frames.shape[0])
    assert counts == [9, 12]
    assert runner.device_sessions["s"].decoder_state_bytes() > 0
    runner.release("s", "test")
    assert "s" not in runner.device_sessions
