"""What every training stage shares: the checkpoint directory and the modules (the loss log and the stage clock:
``train/progress.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import AutoencoderOobleck, WanTransformer3DModel
from safetensors.torch import load_file, save_file

from engine.models.audio_tokens import AudioTiming, AudioTokenProjections
from engine.models.presets import TINY_AUDIO_VAE_CONFIG, TINY_TRANSFORMER_CONFIG, get_preset
from engine.models.text_encoder import WordTextEncoder
from train.codec import TinyCodec
from world.grammar import VOCABULARY

MODULE_FILES = ("codec", "audio_vae", "transformer", "audio_tokens", "text_encoder")


class Checkpoint:
    """A directory of one safetensors file per module plus ``state.json`` (which stages are done, steps taken)."""

    def __init__(self, directory: Path, state_file: str = "state.json") -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        # Two processes may share a directory (the audio stage runs beside the others): one state file each.
        self.state_path = self.directory / state_file
        self.state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {"stages": {}}

    def done(self, stage: str) -> bool:
        return self.state["stages"].get(stage, {}).get("done", False)

    def mark(self, stage: str, **info) -> None:
        self.state["stages"][stage] = {"done": True, **info}
        self.state_path.write_text(json.dumps(self.state, indent=1))

    def save(self, name: str, module: torch.nn.Module, metadata: dict[str, str] | None = None) -> None:
        if isinstance(module, WordTextEncoder):
            module.save(self.directory / f"{name}.safetensors")
            return
        tensors = {k: v.detach().float().cpu().contiguous() for k, v in module.state_dict().items()}  # TinyCodec: its file layout
        save_file(tensors, str(self.directory / f"{name}.safetensors"), metadata=metadata)

    def load_into(self, name: str, module: torch.nn.Module) -> bool:
        path = self.directory / f"{name}.safetensors"
        if not path.exists():
            return False
        module.load_state_dict(load_file(str(path)))
        return True


def load_module_file(path: Path, module: torch.nn.Module) -> bool:
    """Load ``path`` (one module's safetensors) into ``module`` if the file exists (strict)."""
    if not Path(path).exists():
        return False
    module.load_state_dict(load_file(str(path)))
    return True


def latent_stats_metadata(mean: torch.Tensor, std: torch.Tensor) -> dict[str, str]:
    return {"latents_mean": json.dumps([float(x) for x in mean]), "latents_std": json.dumps([float(x) for x in std])}


def build_modules(device) -> dict[str, torch.nn.Module]:
    """The tiny preset's modules, seeded, at their preset configs (what the shipped weights are loaded into)."""
    preset = get_preset("tiny")
    torch.manual_seed(0)
    transformer = WanTransformer3DModel(**TINY_TRANSFORMER_CONFIG)
    codec = TinyCodec(preset.codec_encoder, preset.codec_decoder)
    audio_vae = AutoencoderOobleck(**TINY_AUDIO_VAE_CONFIG)
    timing = AudioTiming(sample_rate=48000, fps=16, hop=600)
    inner = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    audio_tokens = AudioTokenProjections(audio_vae.config.decoder_input_channels, inner, timing.tokens_per_frame)
    text_encoder = WordTextEncoder(VOCABULARY, transformer.config.text_dim, text_len=preset.text_len)
    torch.nn.init.normal_(text_encoder.words.weight, std=1.0)
    torch.nn.init.normal_(text_encoder.positions, std=0.5)
    modules = {
        "codec": codec,
        "audio_vae": audio_vae,
        "transformer": transformer,
        "audio_tokens": audio_tokens,
        "text_encoder": text_encoder,
    }
    return {name: module.to(device) for name, module in modules.items()}
