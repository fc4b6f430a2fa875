"""The published Wan2.1 TAEHV file's encoder half: its layout, loading it from a local file, and when the engine
encodes a Wan model's pictures and camera with it instead of the Wan VAE's encoder."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from decoders.taehv import TAEHVWeightsError, random_taehv
from decoders.taehv_encoder import (
    WAN_TAEHV_ENCODER,
    TAEHVEncoder,
    TAEHVStreamingEncoder,
    TemporalPool,
    load_taehv_encoder,
    model_dir_has_taehv_encoder,
    random_taehv_encoder,
)
from engine.config import EngineConfig

pytestmark = pytest.mark.background  # computes only: runs on the idle core (tests/background_pytest.py)

torch.set_num_threads(1)


def published_state_dict(encoder: TAEHVEncoder) -> dict[str, torch.Tensor]:
    """The encoder's tensors under the published file's names (a temporal pool's weight is ``f`` there), with a
    decoder half beside them, as in taew2_1."""
    pools = {index for index, layer in enumerate(encoder.encoder) if isinstance(layer, TemporalPool)}
    tensors = {}
    for key, value in encoder.state_dict().items():
        index = int(key.split(".")[1])
        tensors[key.replace(".conv.weight", ".f.weight") if index in pools else key] = value.contiguous()
    return tensors | {key: value.contiguous() for key, value in random_taehv(seed=1).state_dict().items()}


def test_the_wan_encoder_config_has_the_published_layout():
    shapes = {key: tuple(value.shape) for key, value in TAEHVEncoder(WAN_TAEHV_ENCODER).state_dict().items()}
    # The published encoder: conv 3->64, ReLU, then three stages of (temporal pool, stride-2 conv without bias,
    # 3 memory blocks of 64), then conv 64->16.
    assert shapes["encoder.0.weight"] == (64, 3, 3, 3) and shapes["encoder.0.bias"] == (64,)
    assert shapes["encoder.2.conv.weight"] == (64, 128, 1, 1)  # pools 2 frames
    assert shapes["encoder.3.weight"] == (64, 64, 3, 3) and "encoder.3.bias" not in shapes
    assert shapes["encoder.4.conv.0.weight"] == (64, 128, 3, 3) and shapes["encoder.6.conv.4.bias"] == (64,)
    assert shapes["encoder.7.conv.weight"] == (64, 128, 1, 1)
    assert shapes["encoder.12.conv.weight"] == (64, 64, 1, 1)  # the last stage pools nothing
    assert shapes["encoder.17.weight"] == (16, 64, 3, 3)
    assert len(shapes) == 2 + 3 * (1 + 1 + 3 * 6) + 2


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_a_published_file_loads_its_encoder_half_and_encodes_as_the_module_it_came_from(tmp_path, suffix):
    original = random_taehv_encoder(3, WAN_TAEHV_ENCODER)
    path = tmp_path / f"taew2_1{suffix}"
    tensors = published_state_dict(original)
    torch.save(tensors, path) if suffix == ".pth" else save_file(tensors, str(path))
    loaded = load_taehv_encoder(path)
    for key, value in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    clip = torch.rand(1, 3, 9, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    streamed, reference = TAEHVStreamingEncoder(loaded), TAEHVStreamingEncoder(original)
    latents = streamed.encode_chunk(clip, streamed.new_state("s"))
    assert torch.equal(latents, reference.encode_chunk(clip, reference.new_state("s")))
    with torch.no_grad():  # every layer on every frame at once: the same function, to float rounding
        assert torch.allclose(latents, original.encode_video(clip), rtol=0, atol=1e-5)
    assert latents.shape == (1, 16, 3, 4, 6)
    assert torch.equal(streamed.normalize(latents), latents)  # the Wan model's normalised space, as its decoder's


def test_a_file_without_an_encoder_or_of_another_shape_is_refused_by_name(tmp_path):
    decoder_only = tmp_path / "decoder_only.pth"
    torch.save(random_taehv(seed=1).state_dict(), decoder_only)
    with pytest.raises(TAEHVWeightsError, match="no TAEHV encoder in the file"):
        load_taehv_encoder(decoder_only)
    tensors = published_state_dict(random_taehv_encoder(3, WAN_TAEHV_ENCODER))
    tensors["encoder.17.weight"] = torch.zeros(32, 64, 3, 3)  # a 32-channel latent space
    del tensors["encoder.4.conv.0.bias"]
    tensors["encoder.99.weight"] = torch.zeros(1)
    torch.save(tensors, tmp_path / "other.pth")
    with pytest.raises(TAEHVWeightsError) as refused:
        load_taehv_encoder(tmp_path / "other.pth")
    message = str(refused.value)
    assert "other.pth" in message and "encoder.4.conv.0.bias" in message and "encoder.99.weight" in message
    assert "encoder.17.weight (32, 64, 3, 3) (expected (16, 64, 3, 3))" in message


def test_the_engine_encodes_with_taehv_where_it_decodes_with_it_and_the_file_has_an_encoder(tmp_path):
    wan = dict(preset="wan2.1-1.3b", random_weights=True)
    assert EngineConfig(**wan).resolved_video_encoder == "wan"
    assert EngineConfig(**wan, video_decoder="taehv").resolved_video_encoder == "taehv"
    assert EngineConfig(**wan, video_decoder="taehv", video_encoder="wan").resolved_video_encoder == "wan"
    assert EngineConfig(**wan, video_decoder="taehv", video_input=False).resolved_video_encoder is None
    assert EngineConfig().resolved_video_encoder == "taehv"  # the tiny preset's own codec
    with pytest.raises(ValidationError, match="video_encoder=taehv reads the TAEHV file's encoder half"):
        EngineConfig(**wan, video_encoder="taehv")
    with pytest.raises(ValidationError, match="video_encoder=wan needs a Wan preset"):
        EngineConfig(video_encoder="wan")
    # Under a GPU memory cap the Wan VAE's encoder (1.07 GiB a session) is off by default, TAEHV's (55 MiB) is not.
    capped = dict(wan, device="cuda", dtype="bfloat16", gpu_memory_gib=24.0)
    assert EngineConfig.model_construct(**capped).resolved_video_encoder is None
    assert EngineConfig.model_construct(**capped, video_decoder="taehv").resolved_video_encoder == "taehv"
    assert EngineConfig.model_construct(**capped, video_decoder="taehv", video_encoder="wan").resolved_video_encoder is None
    assert EngineConfig.model_construct(**capped, video_input=True).resolved_video_encoder == "wan"
    # A model directory: the TAEHV file decides (the published files carry an encoder; one without falls back).
    folder = tmp_path / "taehv"
    folder.mkdir()
    torch.save(random_taehv(seed=1).state_dict(), folder / "taew2_1.pth")
    assert not model_dir_has_taehv_encoder(tmp_path)
    torch.save(published_state_dict(random_taehv_encoder(3, WAN_TAEHV_ENCODER)), folder / "taew2_1.pth")
    assert model_dir_has_taehv_encoder(tmp_path)
    assert not model_dir_has_taehv_encoder(tmp_path / "elsewhere")
