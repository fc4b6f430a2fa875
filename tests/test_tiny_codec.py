"""The tiny preset's video codec: it keeps colour under the project's training step, streams as it decodes whole
clips, and encodes causally. The old tiny Wan VAE runs through the same step as the control that must fail.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from decoders.taehv import TAEHVStreamingDecoder
from engine.models.presets import TINY_CODEC_DECODER, TINY_CODEC_ENCODER, TINY_VAE_CONFIG
from train.codec import OBJECT_WEIGHT, TinyCodec, codec_lr, codec_loss, init_for_training
from world import measure
from world.clips import make_clip
from world.grammar import BACKGROUNDS, COLOURS, SHAPES, Scene

pytestmark = pytest.mark.background  # computes only: runs on the idle core (tests/background_pytest.py)

STEPS = 15  # of the project's codec step (codec_loss, clipping, AdamW, codec_lr's ramp)
PEAK_LR = 2e-3
MIN_SHARE = 0.95
# A 128 x 96 window around the frame's centre, where a still object sits: a third of the pixels (and of the
# control's cost); the background still covers ~90 % of it, as it covers ~97 % of a whole frame.
TOP, LEFT, HEIGHT, WIDTH = 24, 64, 96, 128


def colour_frames() -> tuple[list[Scene], torch.Tensor, torch.Tensor]:
    """Every background twice, every object colour at least twice (never on its own colour), each shape."""
    scenes, colours, k = [], list(COLOURS), 0
    for background in BACKGROUNDS:
        for _ in range(2):
            while colours[k % len(colours)] == background:
                k += 1
            scenes.append(Scene(SHAPES[k % len(SHAPES)], colours[k % len(colours)], "still", background))
            k += 1
    clips = [make_clip(scene, seed, 1) for seed, scene in enumerate(scenes)]
    window = (..., slice(TOP, TOP + HEIGHT), slice(LEFT, LEFT + WIDTH))
    video = torch.stack([clip.video for clip in clips])[window].contiguous()
    weight = (1 + OBJECT_WEIGHT * torch.stack([clip.coverage for clip in clips])).unsqueeze(1)[window].contiguous()
    return scenes, video, weight


class OldTinyWanVAE(torch.nn.Module):
    """The control: the tiny preset's codec of sessions 1-5 (diffusers AutoencoderKLWan at TINY_VAE_CONFIG) with
    session 4's recipe, its initialisation (normal(0, 1/fan_in) convs, zero biases, each residual block's second
    conv zeroed) and its posterior means, behind the codec interface of the same training step."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers import AutoencoderKLWan
        from diffusers.models.autoencoders.autoencoder_kl_wan import WanResidualBlock

        self.vae = AutoencoderKLWan(**TINY_VAE_CONFIG)
        with torch.no_grad():
            for module in self.vae.modules():
                if isinstance(module, (torch.nn.Conv2d, torch.nn.Conv3d)):
                    module.weight.normal_(0.0, module.weight[0].numel() ** -0.5)
                    if module.bias is not None:
                        module.bias.zero_()
            for module in self.vae.modules():
                if isinstance(module, WanResidualBlock):
                    module.conv2.weight.zero_()

    def encode_video(self, video):
        return self.vae.encode(video).latent_dist.mode()

    def decode_video(self, latents, clamp=True):  # diffusers clamps to [-1, 1] inside decode, always
        return self.vae.decode(latents).sample


def train_and_read(codec) -> dict[str, float]:
    """STEPS of the project's step on the colour frames, then the share of frames whose colours read back right."""
    scenes, video, weight = colour_frames()
    params = list(codec.parameters())
    optimizer = torch.optim.AdamW(params, lr=PEAK_LR, weight_decay=0.0)
    for step in range(STEPS):
        optimizer.param_groups[0]["lr"] = codec_lr(PEAK_LR, step, step / STEPS)
        optimizer.zero_grad(set_to_none=True)
        loss, _ = codec_loss(codec, video, weight)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
    with torch.no_grad():
        recon = codec.decode_video(codec.encode_video(video))
    frames = ((recon[:, :, 0] + 1) * 127.5).round().clamp(0, 255).byte().permute(0, 2, 3, 1).numpy()
    readings = [measure.read_frame(frame) for frame in frames]
    return {
        "object_colour": float(np.mean([measure.colour_name(r) == s.colour for r, s in zip(readings, scenes)])),
        "background": float(np.mean([measure.background_name(r) == s.background for r, s in zip(readings, scenes)])),
    }


@pytest.mark.parametrize(
    "make",
    [
        # Why the codec was replaced, kept as a record (11 s of the suite's time): ARSTREAM_SLOW_TESTS=1 runs it.
        pytest.param(OldTinyWanVAE, id="old tiny Wan VAE",
                     marks=[pytest.mark.xfail(strict=True, reason="sessions 1-5's codec: colour not learned in STEPS"),
                            pytest.mark.slow,
                            pytest.mark.skipif(not os.environ.get("ARSTREAM_SLOW_TESTS"),
                                               reason="the replaced codec's record (ARSTREAM_SLOW_TESTS=1 runs it)")]),
        pytest.param(lambda: _initialised(TinyCodec(TINY_CODEC_ENCODER, TINY_CODEC_DECODER)), id="tiny codec"),
    ],
)
def test_the_codec_step_keeps_every_background_and_object_colour(make):
    torch.manual_seed(0)
    scores = train_and_read(make())
    assert scores["background"] >= MIN_SHARE, scores
    assert scores["object_colour"] >= MIN_SHARE, scores


def _initialised(codec: TinyCodec) -> TinyCodec:
    init_for_training(codec)
    return codec


def test_streamed_decode_of_the_tiny_codec_equals_its_whole_clip_decode():
    torch.manual_seed(1)
    codec = TinyCodec(TINY_CODEC_ENCODER, TINY_CODEC_DECODER).double().eval()
    latents = torch.randn(1, 16, 7, 4, 6, dtype=torch.float64)
    decoder = TAEHVStreamingDecoder(codec.decoder_half)
    state = decoder.new_state("s")
    streamed = torch.cat([decoder.decode_chunk(chunk, state) for chunk in latents.split([1, 3, 3], dim=2)], dim=2)
    with torch.no_grad():
        whole = codec.decode_video(latents)
    assert streamed.shape == whole.shape == (1, 3, 25, 32, 48)
    assert (streamed - whole).abs().max().item() <= 1e-12


def test_the_encoder_is_causal_and_starts_as_its_colour_shortcut():
    torch.manual_seed(2)
    codec = TinyCodec(TINY_CODEC_ENCODER, TINY_CODEC_DECODER).double()
    video = torch.rand(1, 3, 13, 32, 48, dtype=torch.float64) * 2 - 1
    changed = video.clone()
    changed[:, :, 5] += 0.5  # latent frame 2 covers video frames 5-8
    with torch.no_grad():
        difference = (codec.encode_video(changed) - codec.encode_video(video)).abs().amax(dim=(0, 1, 3, 4))
    assert difference[:2].max() == 0 and difference[2] > 0
    init_for_training(codec)
    flat = torch.tensor([0.5, -0.2, 0.9], dtype=torch.float64).view(1, 3, 1, 1, 1).expand(1, 3, 5, 32, 48)
    with torch.no_grad():
        latents = codec.encode_video(flat)
        assert torch.allclose(latents[0, :3, :, 1, 1].T, ((flat[0, :, 0, 0, 0] + 1) / 2).expand(2, 3))
        assert latents[0, 3:].abs().max() == 0
        assert torch.allclose(codec.decode_video(latents), flat)


def test_the_codec_file_layout_loads_each_half_alone(tmp_path):
    from safetensors.torch import load_file, save_file

    codec = TinyCodec(TINY_CODEC_ENCODER, TINY_CODEC_DECODER)
    save_file({k: v.contiguous() for k, v in codec.state_dict().items()}, str(tmp_path / "codec.safetensors"))
    tensors = load_file(str(tmp_path / "codec.safetensors"))
    assert {key.split(".")[0] for key in tensors} == {"encoder", "decoder"}
    again = TinyCodec(TINY_CODEC_ENCODER, TINY_CODEC_DECODER)
    again.load_state_dict(tensors)
    assert all(torch.equal(again.state_dict()[key], value) for key, value in tensors.items())


def test_the_tiny_preset_streams_through_its_own_codec_and_refuses_the_wan_vae():
    from engine.bundle import build_models
    from engine.config import EngineConfig

    trained = build_models(EngineConfig(warmup_blocks=0, audio=False)).decoder
    random = build_models(EngineConfig(warmup_blocks=0, audio=False, random_weights=True)).decoder
    assert isinstance(trained, TAEHVStreamingDecoder) and isinstance(random, TAEHVStreamingDecoder)
    assert trained.model.config == TINY_CODEC_DECODER
    latents = torch.ones(1, 16, 1, 2, 2)
    assert not torch.equal(trained.denormalize(latents), latents)  # the codec's latent statistics, undone
    assert random.denormalize(latents) is latents
    with pytest.raises(ValueError, match="no Wan VAE"):
        EngineConfig(video_decoder="wan")
