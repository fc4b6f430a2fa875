"""Loading real models from a local directory: a tiny diffusers-layout Wan directory and original-format causal weights.

Everything is built here, offline, at toy size: a Wan DiT and VAE from the tiny preset's configs, a 2-layer
UMT5 encoder, and a word-level tokenizer made with ``tokenizers``. The original-format checkpoint is written
from the literal list of Wan's own parameter names below (not from any mapping run backwards).
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from pydantic import ValidationError
from safetensors.torch import load_file, save_file
from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

from decoders.video import WanStreamingDecoder
from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.bundle import build_models
from engine.models.causal_wan import CausalWanTransformer
from engine.models.loading import (
    ModelLoadError,
    UMT5TextEncoder,
    load_model_dir,
    load_text_encoder,
    load_transformer,
    read_causal_state_dict,
)
from engine.models.pipeline import CausalWanPipeline
from engine.models.presets import TINY_VAE_CONFIG
from tests.engine_helpers import SMALL_TRANSFORMER_CONFIG
from engine.models.random_text import word_tokenizer
from engine.models.schedule import shifted_sigmas
from engine.plan import OpenSession, SessionWork, StepPlan
from engine.runner import Runner

SMALL = {"height": 48, "width": 64, "warmup_blocks": 0, "max_sessions": 1}
WORDS = "a red fox runs over the snowy hill at night under blue sky sea waves crash on rocks".split()

# --- the original Wan parameter names of the tiny config (dim 64 = 2 heads x 32, ffn 128, text 32, freq 32,
# 16 channels, patch 1x2x2, 2 layers, cross-attention norm), each with its diffusers name and shape. Written
# out from Wan's module names (WanModel: patch_embedding, text_embedding = Linear/GELU/Linear, time_embedding =
# Linear/SiLU/Linear, time_projection = SiLU/Linear, blocks[i]: modulation, self_attn/cross_attn q/k/v/o/norm_q/
# norm_k, norm3 (the affine cross-attention norm), ffn = Linear/GELU/Linear; head: head, modulation) and the
# diffusers WanTransformer3DModel it becomes.
ORIGINAL_GLOBAL_KEYS = [
    ("patch_embedding.weight", "patch_embedding.weight", (64, 16, 1, 2, 2)),
    ("patch_embedding.bias", "patch_embedding.bias", (64,)),
    ("text_embedding.0.weight", "condition_embedder.text_embedder.linear_1.weight", (64, 32)),
    ("text_embedding.0.bias", "condition_embedder.text_embedder.linear_1.bias", (64,)),
    ("text_embedding.2.weight", "condition_embedder.text_embedder.linear_2.weight", (64, 64)),
    ("text_embedding.2.bias", "condition_embedder.text_embedder.linear_2.bias", (64,)),
    ("time_embedding.0.weight", "condition_embedder.time_embedder.linear_1.weight", (64, 32)),
    ("time_embedding.0.bias", "condition_embedder.time_embedder.linear_1.bias", (64,)),
    ("time_embedding.2.weight", "condition_embedder.time_embedder.linear_2.weight", (64, 64)),
    ("time_embedding.2.bias", "condition_embedder.time_embedder.linear_2.bias", (64,)),
    ("time_projection.1.weight", "condition_embedder.time_proj.weight", (384, 64)),
    ("time_projection.1.bias", "condition_embedder.time_proj.bias", (384,)),
    ("head.head.weight", "proj_out.weight", (64, 64)),
    ("head.head.bias", "proj_out.bias", (64,)),
    ("head.modulation", "scale_shift_table", (1, 2, 64)),
]
ORIGINAL_BLOCK_KEYS = [  # per block; {i} is the block index
    ("blocks.{i}.modulation", "blocks.{i}.scale_shift_table", (1, 6, 64)),
    ("blocks.{i}.self_attn.q.weight", "blocks.{i}.attn1.to_q.weight", (64, 64)),
    ("blocks.{i}.self_attn.q.bias", "blocks.{i}.attn1.to_q.bias", (64,)),
    ("blocks.{i}.self_attn.k.weight", "blocks.{i}.attn1.to_k.weight", (64, 64)),
    ("blocks.{i}.self_attn.k.bias", "blocks.{i}.attn1.to_k.bias", (64,)),
    ("blocks.{i}.self_attn.v.weight", "blocks.{i}.attn1.to_v.weight", (64, 64)),
    ("blocks.{i}.self_attn.v.bias", "blocks.{i}.attn1.to_v.bias", (64,)),
    ("blocks.{i}.self_attn.o.weight", "blocks.{i}.attn1.to_out.0.weight", (64, 64)),
    ("blocks.{i}.self_attn.o.bias", "blocks.{i}.attn1.to_out.0.bias", (64,)),
    ("blocks.{i}.self_attn.norm_q.weight", "blocks.{i}.attn1.norm_q.weight", (64,)),
    ("blocks.{i}.self_attn.norm_k.weight", "blocks.{i}.attn1.norm_k.weight", (64,)),
    ("blocks.{i}.norm3.weight", "blocks.{i}.norm2.weight", (64,)),
    ("blocks.{i}.norm3.bias", "blocks.{i}.norm2.bias", (64,)),
    ("blocks.{i}.cross_attn.q.weight", "blocks.{i}.attn2.to_q.weight", (64, 64)),
    ("blocks.{i}.cross_attn.q.bias", "blocks.{i}.attn2.to_q.bias", (64,)),
    ("blocks.{i}.cross_attn.k.weight", "blocks.{i}.attn2.to_k.weight", (64, 64)),
    ("blocks.{i}.cross_attn.k.bias", "blocks.{i}.attn2.to_k.bias", (64,)),
    ("blocks.{i}.cross_attn.v.weight", "blocks.{i}.attn2.to_v.weight", (64, 64)),
    ("blocks.{i}.cross_attn.v.bias", "blocks.{i}.attn2.to_v.bias", (64,)),
    ("blocks.{i}.cross_attn.o.weight", "blocks.{i}.attn2.to_out.0.weight", (64, 64)),
    ("blocks.{i}.cross_attn.o.bias", "blocks.{i}.attn2.to_out.0.bias", (64,)),
    ("blocks.{i}.cross_attn.norm_q.weight", "blocks.{i}.attn2.norm_q.weight", (64,)),
    ("blocks.{i}.cross_attn.norm_k.weight", "blocks.{i}.attn2.norm_k.weight", (64,)),
    ("blocks.{i}.ffn.0.weight", "blocks.{i}.ffn.net.0.proj.weight", (128, 64)),
    ("blocks.{i}.ffn.0.bias", "blocks.{i}.ffn.net.0.proj.bias", (128,)),
    ("blocks.{i}.ffn.2.weight", "blocks.{i}.ffn.net.2.weight", (64, 128)),
    ("blocks.{i}.ffn.2.bias", "blocks.{i}.ffn.net.2.bias", (64,)),
]
ORIGINAL_KEYS = ORIGINAL_GLOBAL_KEYS + [
    (original.format(i=i), diffusers.format(i=i), shape) for i in range(2) for original, diffusers, shape in ORIGINAL_BLOCK_KEYS
]


@dataclass
class TinyParts:
    transformer: WanTransformer3DModel
    vae: AutoencoderKLWan
    umt5: UMT5EncoderModel
    tokenizer: PreTrainedTokenizerFast


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer with T5's conventions: ``</s>`` after the tokens, ``<pad>`` = 0."""
    return word_tokenizer(WORDS)


@pytest.fixture(scope="module")
def parts() -> TinyParts:
    torch.manual_seed(11)
    transformer = WanTransformer3DModel(**SMALL_TRANSFORMER_CONFIG).eval()
    torch.manual_seed(12)
    vae = AutoencoderKLWan(**TINY_VAE_CONFIG).eval()
    torch.manual_seed(13)
    tokenizer = tiny_tokenizer()
    umt5_config = UMT5Config(
        vocab_size=len(tokenizer), d_model=SMALL_TRANSFORMER_CONFIG["text_dim"], d_kv=8, d_ff=64, num_layers=2,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=32, dropout_rate=0.0,
        feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )
    umt5 = UMT5EncoderModel(umt5_config).eval()
    return TinyParts(transformer, vae, umt5, tokenizer)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, parts) -> Path:
    root = tmp_path_factory.mktemp("wan-tiny")
    parts.transformer.save_pretrained(root / "transformer")
    parts.vae.save_pretrained(root / "vae")
    parts.umt5.save_pretrained(root / "text_encoder")
    parts.tokenizer.save_pretrained(root / "tokenizer")
    return root


def linked_model_dir(source: Path, target: Path, *, skip: tuple[str, ...] = (), settings: dict | None = None) -> Path:
    """A model directory sharing ``source``'s parts (symlinks), with its own arstream.json."""
    target.mkdir(parents=True, exist_ok=True)
    for part in ("transformer", "vae", "text_encoder", "tokenizer"):
        if part not in skip:
            os.symlink(source / part, target / part)
    if settings is not None:
        (target / "arstream.json").write_text(json.dumps(settings))
    return target


def original_state_dict(seed: int) -> dict[str, torch.Tensor]:
    """Original-format tensors of the tiny config, Wan names, deterministic values."""
    generator = torch.Generator().manual_seed(seed)
    return {name: 0.1 * torch.randn(shape, generator=generator) for name, _, shape in ORIGINAL_KEYS}


def write_checkpoint(path: Path, ema: dict[str, torch.Tensor], plain: dict[str, torch.Tensor] | None = None) -> Path:
    """As Self-Forcing/CausVid save them: ``generator_ema`` (and ``generator``) with a ``model.`` prefix."""
    plain = plain if plain is not None else original_state_dict(99)
    if path.suffix == ".safetensors":
        flat = {f"generator_ema.model.{k}": v for k, v in ema.items()}
        flat.update({f"generator.model.{k}": v for k, v in plain.items()})
        save_file({k: v.contiguous() for k, v in flat.items()}, str(path))
    else:
        torch.save(
            {
                "generator": {f"model.{k}": v for k, v in plain.items()},
                "generator_ema": {f"model.{k}": v for k, v in ema.items()},
                "step": 1000,  # a non-tensor leaf, as training checkpoints have
            },
            path,
        )
    return path


def reference_pipeline(parts: TinyParts, config: EngineConfig) -> tuple[CausalWanPipeline, WanStreamingDecoder]:
    """The in-memory modules wired the way build_models wires a loaded directory."""
    causal = CausalWanTransformer(
        copy.deepcopy(parts.transformer), latent_height=config.resolved_height // 8, latent_width=config.resolved_width // 8
    )
    pipeline = CausalWanPipeline(
        causal,
        UMT5TextEncoder(copy.deepcopy(parts.umt5), copy.deepcopy(parts.tokenizer)),
        sigmas=shifted_sigmas(config.timesteps, config.shift),
        frames_per_block=config.frames_per_block,
        sink_frames=config.sink_frames,
        window_frames=config.window_frames,
        guidance_scale=config.guidance_scale,
    )
    return pipeline, WanStreamingDecoder(copy.deepcopy(parts.vae))


def run_blocks(
    pipeline, decoder, blocks: int, prompt: str = "a red fox runs", negative: str = "night", device: str = "cpu"
) -> list[np.ndarray]:
    runner = Runner(pipeline, decoder, KVCacheManager(pipeline.kv_spec(), 1, device))
    outputs = []
    work = SessionWork("s", open=OpenSession(seed=5, prompt=prompt, negative_prompt=negative), run=True)
    for _ in range(blocks):
        result = runner.execute(StepPlan(work=[work]))
        assert not result.failures, result.failures
        outputs += [output.frames for output in result.outputs]
        work = SessionWork("s", run=True)
    return outputs


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


# --- the diffusers-layout directory --------------------------------------------------------------------


def test_model_dir_loads_back_to_the_in_memory_model(model_dir, parts):
    config = EngineConfig(model_dir=model_dir, guidance_scale=2.0, sink_frames=1, window_frames=2, **SMALL)
    bundle = build_models(config)
    assert_same_weights(bundle.pipeline.transformer.transformer, parts.transformer)
    assert_same_weights(bundle.decoder.vae, parts.vae)
    assert_same_weights(bundle.pipeline.text_encoder.model, parts.umt5)

    pipeline, decoder = reference_pipeline(parts, config)
    for prompt in ("a red fox runs", "", "blue sea waves"):
        assert torch.equal(bundle.pipeline.embed(prompt), pipeline.embed(prompt))
    loaded_frames = run_blocks(bundle.pipeline, bundle.decoder, blocks=2)
    reference_frames = run_blocks(pipeline, decoder, blocks=2)
    assert [f.shape for f in loaded_frames] == [(9, 48, 64, 3), (12, 48, 64, 3)]
    for loaded, reference in zip(loaded_frames, reference_frames):
        assert np.array_equal(loaded, reference)
    assert loaded_frames[0].std() > 1.0  # real pictures, not a constant


def test_text_embeddings_are_zero_after_the_tokens_and_long_prompts_truncate(model_dir, caplog):
    encoder = load_text_encoder(model_dir, torch.float32)
    assert (encoder.text_len, encoder.text_dim) == (512, SMALL_TRANSFORMER_CONFIG["text_dim"])
    short = encoder.encode(["a red fox"])  # 3 words + </s>
    assert short.shape == (1, 512, 32) and short.dtype == torch.float32 and short.device.type == "cpu"
    assert (short[0, :4].abs().sum(dim=1) > 0).all()
    assert torch.count_nonzero(short[0, 4:]) == 0
    # whitespace and HTML entities are cleaned as Wan cleans prompts
    assert torch.equal(encoder.encode(["  a\n red \t fox "]), short)
    # documented truncation: the first 511 tokens + </s>, and a warning without the prompt text
    words = (WORDS * 40)[:600]
    with caplog.at_level("WARNING", logger="arstream.models"):
        long = encoder.encode([" ".join(words)])
    assert torch.equal(long, encoder.encode([" ".join(words[:511])]))
    assert torch.count_nonzero(long[0].abs().sum(dim=1)) == 512
    assert any("truncated" in record.getMessage() for record in caplog.records)
    assert all("fox" not in record.getMessage() for record in caplog.records)


def test_text_encode_on_the_prompt_tokens_equals_wans_padded_encode(model_dir):
    """The fast path runs the encoder on the prompts' tokens only; Wan runs it on all 512 positions."""
    encoder = load_text_encoder(model_dir, torch.float32)
    prompts = ["a red fox", " ".join((WORDS * 4)[:30]), "fox"]  # a batch of different lengths
    fast, reference = encoder.encode(prompts), encoder.encode_padded(prompts)
    assert fast.shape == reference.shape == (3, 512, 32)
    assert torch.count_nonzero(reference[0, :4].abs().sum(dim=1)) == 4  # real states, not zeros
    assert torch.allclose(fast, reference, rtol=0, atol=1e-5 * float(reference.abs().max()))
    for one, prompt in enumerate(prompts):  # alone or in a batch: the same rows
        assert torch.allclose(encoder.encode([prompt])[0], fast[one], atol=1e-5 * float(reference.abs().max()))


def test_text_encoder_graph_buckets_pad_without_changing_the_prompt_states(model_dir):
    """The CUDA graphs pad a prompt to a bucket length with mask 0; that padding leaves its states as they are."""
    from engine.models.text_graphs import bucket_for, token_buckets

    buckets = token_buckets(512)
    assert buckets == (16, 32, 64, 128, 256, 512) and token_buckets(20) == (16, 20)
    assert [bucket_for(n, buckets) for n in (1, 16, 17, 300, 512)] == [16, 16, 32, 512, 512]
    with pytest.raises(ValueError, match="513 tokens"):
        bucket_for(513, buckets)
    encoder = load_text_encoder(model_dir, torch.float32)
    tokens = encoder.tokenizer(["a red fox"], return_tensors="pt")
    ids, mask = tokens["input_ids"], tokens["attention_mask"]
    length = ids.shape[1]
    padded_ids, padded_mask = torch.zeros(1, 16, dtype=torch.long), torch.zeros(1, 16, dtype=torch.long)
    padded_ids[:, :length], padded_mask[:, :length] = ids, mask
    exact = encoder._states(ids, mask)
    padded = encoder._states(padded_ids, padded_mask)[:, :length]
    assert torch.allclose(padded, exact, atol=1e-5 * float(exact.abs().max()))
    assert encoder.graphed is None  # graphs only when asked for (the engine asks on CUDA)


def test_model_dir_settings_fill_what_settings_leave_unset(model_dir, tmp_path, monkeypatch):
    from app.cli import _engine_config, _settings_from, build_parser
    from app.settings import Settings

    settings = {"sink_frames": 2, "window_frames": 4, "timesteps": [1000, 750, 500], "shift": 3.0, "height": 32}
    directory = linked_model_dir(model_dir, tmp_path / "m", settings=settings)
    config = EngineConfig(model_dir=directory)
    assert (config.sink_frames, config.window_frames, config.timesteps, config.shift, config.height) == (
        2, 4, [1000, 750, 500], 3.0, 32,
    )
    assert config.frames_per_block == 3 and config.causal_weights is None  # not in the file: defaults
    explicit = EngineConfig(model_dir=directory, sink_frames=1, height=None)  # given wins; None = not given
    assert (explicit.sink_frames, explicit.window_frames, explicit.height) == (1, 4, 32)

    # the CLI: flags left out take the file's values, flags given win
    args = build_parser().parse_args(["generate", "--prompt", "x", "--model", str(directory)])
    assert _engine_config(args).sink_frames == 2
    args = build_parser().parse_args(["generate", "--prompt", "x", "--model", str(directory), "--window-frames", "7"])
    assert _engine_config(args).window_frames == 7
    args = build_parser().parse_args(["serve", "--model", str(directory), "--sink-frames", "3"])
    served = _settings_from(args).engine
    assert (served.sink_frames, served.window_frames) == (3, 4)
    # ARSTREAM_* variables are explicit settings too
    monkeypatch.setenv("ARSTREAM_ENGINE__MODEL_DIR", str(directory))
    monkeypatch.setenv("ARSTREAM_ENGINE__WINDOW_FRAMES", "9")
    engine = Settings().engine
    assert (engine.model_dir, engine.sink_frames, engine.window_frames) == (directory, 2, 9)


# --- original-format causal weights ---------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_original_format_causal_weights_map_to_diffusers_names(model_dir, tmp_path, suffix):
    ema = original_state_dict(seed=1)
    path = write_checkpoint(tmp_path / f"self_forcing{suffix}", ema)

    state = read_causal_state_dict(path)  # generator_ema chosen over generator, model. prefix stripped
    assert state.keys() == ema.keys()
    assert all(torch.equal(state[k], ema[k]) for k in ema)

    transformer = load_transformer(model_dir, torch.float32, causal_weights=path)
    loaded = transformer.state_dict()
    for original, diffusers_name in [
        ("blocks.0.self_attn.q.weight", "blocks.0.attn1.to_q.weight"),
        ("blocks.1.cross_attn.o.bias", "blocks.1.attn2.to_out.0.bias"),
        ("blocks.0.norm3.weight", "blocks.0.norm2.weight"),  # Wan's norm3 is the cross-attention norm
        ("blocks.1.modulation", "blocks.1.scale_shift_table"),
        ("head.modulation", "scale_shift_table"),
        ("head.head.weight", "proj_out.weight"),
        ("time_projection.1.weight", "condition_embedder.time_proj.weight"),
        ("text_embedding.2.bias", "condition_embedder.text_embedder.linear_2.bias"),
        ("blocks.0.ffn.0.weight", "blocks.0.ffn.net.0.proj.weight"),
    ]:
        assert torch.equal(loaded[diffusers_name], ema[original]), original

    # the whole model: a diffusers forward equals one of a model filled from the expected names
    expected = WanTransformer3DModel(**SMALL_TRANSFORMER_CONFIG).eval()
    expected.load_state_dict({d: ema[o] for o, d, _ in ORIGINAL_KEYS}, strict=True)
    generator = torch.Generator().manual_seed(3)
    latents = torch.randn(1, 16, 2, 6, 8, generator=generator)
    text = torch.randn(1, 12, 32, generator=generator)
    with torch.no_grad():
        want = expected(latents, torch.tensor([625.0]), text, return_dict=False)[0]
        got = transformer(latents, torch.tensor([625.0]), text, return_dict=False)[0]
    assert torch.equal(got, want)


def test_causal_weights_named_in_arstream_json_run_a_block(model_dir, tmp_path):
    ema = original_state_dict(seed=2)
    directory = linked_model_dir(model_dir, tmp_path / "m", settings={"causal_weights": "causal.safetensors", "sink_frames": 1})
    write_checkpoint(directory / "causal.safetensors", ema)
    # transformer/ holds only its config here: causal weights replace its weights, which are not read
    (directory / "transformer").unlink()
    (directory / "transformer").mkdir()
    (directory / "transformer" / "config.json").write_text((model_dir / "transformer" / "config.json").read_text())

    config = EngineConfig(model_dir=directory, window_frames=2, **SMALL)
    assert config.causal_weights == directory / "causal.safetensors"
    bundle = build_models(config)
    weights = bundle.pipeline.transformer.transformer.state_dict()
    assert torch.equal(weights["blocks.1.attn1.norm_k.weight"], ema["blocks.1.self_attn.norm_k.weight"])
    frames = run_blocks(bundle.pipeline, bundle.decoder, blocks=1)
    assert frames[0].shape == (9, 48, 64, 3)


def test_fp8_quantizes_the_loaded_causal_weights(model_dir, tmp_path):
    """fp8 = linear converts the weights the directory's causal file put in, not the ones they replaced."""
    from engine.models.fp8_linear import FP8Linear

    ema = original_state_dict(seed=2)
    directory = linked_model_dir(model_dir, tmp_path / "m")
    write_checkpoint(directory / "causal.safetensors", ema)
    config = EngineConfig(model_dir=directory, causal_weights=directory / "causal.safetensors", dtype="bfloat16",
                          fp8="linear", sink_frames=1, window_frames=2, **SMALL)
    bundle = build_models(config)
    assert bundle.fp8.converted == 8 * 2
    layer = bundle.pipeline.transformer.transformer.blocks[1].ffn.net[2]
    assert isinstance(layer, FP8Linear)
    loaded = ema["blocks.1.ffn.2.weight"].bfloat16().float()
    # e4m3 rounding of the loaded weight: within half a step (2^-4 relative; subnormals 2^-10 of the row scale)
    bound = torch.maximum(2.0**-4 * loaded.abs(), 2.0**-10 * layer.weight_scale.t())
    assert ((layer.dequantized_weight() - loaded).abs() <= bound).all()
    frames = run_blocks(bundle.pipeline, bundle.decoder, blocks=1)
    assert frames[0].shape == (9, 48, 64, 3)


# --- errors ---------------------------------------------------------------------------------------------------


class NotAWeight:
    """Something a pickle may hold that torch.load(weights_only=True) must refuse."""


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("shape", "'blocks.0.self_attn.q.weight' (diffusers 'blocks.0.attn1.to_q.weight') has shape (64, 32)"),
        ("unknown", "unknown key(s) blocks.0.self_attn.extra.weight"),
        ("missing", "missing key(s) (diffusers names) scale_shift_table"),
        ("dtype", "'head.head.bias' has dtype torch.int64"),
    ],
)
def test_causal_weight_errors_name_the_file_and_key(model_dir, tmp_path, suffix, change, message):
    state = original_state_dict(seed=4)
    if change == "shape":
        state["blocks.0.self_attn.q.weight"] = torch.zeros(64, 32)
    elif change == "unknown":
        state["blocks.0.self_attn.extra.weight"] = torch.zeros(3)
    elif change == "missing":
        del state["head.modulation"]
    else:
        state["head.head.bias"] = torch.zeros(64, dtype=torch.int64)
    path = write_checkpoint(tmp_path / f"bad{suffix}", state)
    with pytest.raises(ModelLoadError) as error:
        load_transformer(model_dir, torch.float32, causal_weights=path)
    assert message in str(error.value) and str(path) in str(error.value)


def test_unreadable_causal_weights_are_refused_with_their_reason(model_dir, tmp_path):
    cases = {
        tmp_path / "absent.safetensors": "no such file",
        tmp_path / "weights.npz": "unknown file type .npz",
        tmp_path / "pickled.pt": "refused by torch.load(weights_only=True)",
        tmp_path / "garbage.safetensors": "not a readable safetensors file",
        tmp_path / "empty.pt": "holds no tensors",
    }
    (tmp_path / "weights.npz").write_bytes(b"\0")
    torch.save({"generator_ema": {"model.head.head.bias": torch.zeros(64)}, "extra": NotAWeight()}, tmp_path / "pickled.pt")
    (tmp_path / "garbage.safetensors").write_bytes(b"not a header")
    torch.save({"step": 3}, tmp_path / "empty.pt")
    for path, message in cases.items():
        with pytest.raises(ModelLoadError) as error:
            load_transformer(model_dir, torch.float32, causal_weights=path)
        assert message in str(error.value) and str(path) in str(error.value), (path, str(error.value))


def test_model_dir_errors_name_the_missing_or_broken_part(model_dir, tmp_path):
    config = EngineConfig(model_dir=model_dir, **SMALL)

    def fails(directory: Path, message: str, **update) -> None:
        with pytest.raises(ModelLoadError) as error:
            load_model_dir(directory, **{"device": config.device, "dtype": config.torch_dtype, **update})
        assert message in str(error.value), str(error.value)

    fails(tmp_path / "absent", f"model directory {tmp_path / 'absent'}: no such directory")
    fails(linked_model_dir(model_dir, tmp_path / "no-vae", skip=("vae",)), str(tmp_path / "no-vae" / "vae" / "config.json"))
    fails(linked_model_dir(model_dir, tmp_path / "no-tok", skip=("tokenizer",)), str(tmp_path / "no-tok" / "tokenizer"))

    # transformer/ without weights (and no causal weights to replace them)
    bare = linked_model_dir(model_dir, tmp_path / "bare", skip=("transformer",))
    (bare / "transformer").mkdir()
    transformer_config = json.loads((model_dir / "transformer" / "config.json").read_text())
    (bare / "transformer" / "config.json").write_text(json.dumps(transformer_config))
    fails(bare, "diffusion_pytorch_model.safetensors")

    # weights of another shape than transformer/config.json says
    wrong = linked_model_dir(model_dir, tmp_path / "wrong", skip=("transformer",))
    WanTransformer3DModel(**{**SMALL_TRANSFORMER_CONFIG, "ffn_dim": 96}).save_pretrained(wrong / "transformer")
    (wrong / "transformer" / "config.json").write_text(json.dumps(transformer_config))
    fails(wrong, "expected shape torch.Size([128")  # ffn.net.0.proj's weight or bias, 96 rows in the file

    # a weight missing and an unknown one: diffusers only warns, we refuse
    partial = linked_model_dir(model_dir, tmp_path / "partial", skip=("transformer",))
    (partial / "transformer").mkdir()
    (partial / "transformer" / "config.json").write_text(json.dumps(transformer_config))
    weights = load_file(str(model_dir / "transformer" / "diffusion_pytorch_model.safetensors"))
    weights.pop("proj_out.bias")
    weights["extra.weight"] = torch.zeros(2)
    save_file(weights, str(partial / "transformer" / "diffusion_pytorch_model.safetensors"))
    fails(partial, "1 missing key(s): proj_out.bias; 1 unknown key(s): extra.weight")

    # parts that do not fit each other
    mismatched = linked_model_dir(model_dir, tmp_path / "mismatched", skip=("transformer",))
    (mismatched / "transformer").mkdir()
    (mismatched / "transformer" / "config.json").write_text(json.dumps({**transformer_config, "text_dim": 48}))
    fails(mismatched, "d_model 32 does not match the transformer's text_dim 48")

    # a dtype this device cannot run: the config refuses it, and so does the loader on its own
    with pytest.raises(ValidationError, match="dtype float16 needs a CUDA device"):
        EngineConfig(model_dir=model_dir, dtype="float16")
    fails(model_dir, "dtype torch.float16 is not supported on the CPU", dtype=torch.float16)


def test_config_errors_for_model_settings(model_dir, tmp_path):
    with pytest.raises(ValidationError, match="no such directory"):
        EngineConfig(model_dir=tmp_path / "absent")
    with pytest.raises(ValidationError, match="causal_weights needs model_dir"):
        EngineConfig(causal_weights=tmp_path / "w.safetensors")
    unknown = linked_model_dir(model_dir, tmp_path / "unknown", settings={"sink_frames": 1, "layers": 3})
    with pytest.raises(ValidationError, match=r"arstream.json: unknown key\(s\) \['layers'\]"):
        EngineConfig(model_dir=unknown)
    invalid = linked_model_dir(model_dir, tmp_path / "invalid", settings={"window_frames": 0})
    with pytest.raises(ValidationError, match="window_frames"):
        EngineConfig(model_dir=invalid)
    broken = linked_model_dir(model_dir, tmp_path / "broken")
    (broken / "arstream.json").write_text("{sink_frames: 1")
    with pytest.raises(ValidationError, match="arstream.json: cannot be read as JSON"):
        EngineConfig(model_dir=broken)


# --- on a GPU (run on the device machine: pytest -m gpu) ----------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_model_dir_runs_on_cuda_in_reduced_precision(model_dir, tmp_path, dtype):
    weights = write_checkpoint(tmp_path / "causal.safetensors", original_state_dict(seed=6))
    torch_dtype = getattr(torch, dtype)
    for causal in (None, weights):
        config = EngineConfig(model_dir=model_dir, causal_weights=causal, device="cuda", dtype=dtype, guidance_scale=2.0, **SMALL)
        bundle = build_models(config)
        transformer = bundle.pipeline.transformer.transformer
        assert transformer.patch_embedding.weight.device.type == "cuda"
        assert transformer.patch_embedding.weight.dtype == torch_dtype
        assert transformer.scale_shift_table.dtype == torch.float32  # diffusers' fp32 modules stay fp32
        assert next(bundle.decoder.vae.parameters()).dtype == torch_dtype
        assert bundle.pipeline.text_encoder.device.type == "cuda"

        reference = build_models(config.model_copy(update={"device": "cpu", "dtype": "float32"}))
        embedding, expected = bundle.pipeline.embed("a red fox runs"), reference.pipeline.embed("a red fox runs")
        assert embedding.dtype == torch.float32 and embedding.device.type == "cpu"
        assert torch.count_nonzero(embedding[0, 5:]) == 0
        assert (embedding - expected).abs().max() < 0.05 * expected.abs().max()

        frames = run_blocks(bundle.pipeline, bundle.decoder, blocks=2, device="cuda")
        reference_frames = run_blocks(reference.pipeline, reference.decoder, blocks=2)
        assert [f.shape for f in frames] == [(9, 48, 64, 3), (12, 48, 64, 3)]
        for got, want in zip(frames, reference_frames):
            difference = np.abs(got.astype(np.float32) - want.astype(np.float32)).mean()
            print(f"{dtype} causal={causal is not None}: mean |cuda - cpu fp32| = {difference:.2f} / 255")
            assert difference < 4.0  # seen: 0.7 (bf16), 0.1 (fp16) on an H200


def test_preflight_passes_a_good_model_dir_and_counts_its_weights_from_the_file_headers(model_dir, parts, tmp_path):
    from engine.memory import estimate_weight_bytes
    from engine.preflight import check_before_build

    config = EngineConfig(model_dir=model_dir, **SMALL)
    check_before_build(config)  # nothing is raised, nothing is loaded
    parameters = sum(p.numel() for module in (parts.transformer, parts.vae, parts.umt5) for p in module.parameters())
    # the headers count stored tensors: UMT5's tied token embedding is stored once, buffers are few
    assert abs(estimate_weight_bytes(config) - 4 * parameters) <= 0.05 * 4 * parameters
    without_vae_weights = linked_model_dir(model_dir, tmp_path / "no-vae-weights", skip=("vae",))
    (without_vae_weights / "vae").mkdir()
    (without_vae_weights / "vae" / "config.json").write_text((model_dir / "vae" / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"no-vae-weights/vae: no \*\.safetensors weights"):
        check_before_build(EngineConfig(model_dir=without_vae_weights, **SMALL))


# --- pictures and video in through a model directory's codec ---------------------------------------------


def test_model_dir_wan_vae_encodes_pictures_and_live_input(model_dir, parts):
    """The Wan VAE's own encoder (a streaming state per session): an image start shows the VAE's round trip of
    the image first, and live input at strength 0 is the round trip of the input, frame for frame."""
    from decoders.video_encode import WanStreamingEncoder
    from tests.input_helpers import run_session

    config = EngineConfig(model_dir=model_dir, sink_frames=1, window_frames=2, **SMALL)
    bundle = build_models(config)
    assert isinstance(bundle.encoder, WanStreamingEncoder)
    runner = Runner(bundle.pipeline, bundle.decoder, KVCacheManager(bundle.pipeline.kv_spec(), 1, "cpu"),
                    encoder=bundle.encoder)
    frames = np.random.default_rng(3).integers(0, 256, (21, 48, 64, 3), dtype=np.uint8)
    vae = copy.deepcopy(parts.vae)
    with torch.no_grad():  # diffusers' own encode and decode of the same frames, one call each
        video = torch.from_numpy(frames).permute(3, 0, 1, 2).unsqueeze(0).float() / 127.5 - 1.0
        expected = vae.decode(vae.encode(video).latent_dist.mode()).sample.clamp(-1, 1)
    expected = ((expected[0].permute(1, 2, 3, 0) + 1) / 2 * 255).round().clamp(0, 255).to(torch.uint8).numpy()
    image = run_session(runner, "image", "a red fox runs", blocks=1, context=frames[:1])
    assert image[0].shape[0] == 1 and np.abs(image[0][0].astype(int) - expected[0].astype(int)).max() <= 1
    live = np.concatenate(run_session(runner, "live", "a red fox runs", blocks=2, live=frames, strength=0.0))
    # diffusers decodes post_quant_conv over the whole clip, the stream frame by frame (the decoder's docs).
    assert live.shape[0] == 21 and np.abs(live.astype(int) - expected.astype(int)).max() <= 2


def _assert_live_at_strength_zero_is_the_round_trip(bundle) -> None:
    """A live session at strength 0 shows the codec's round trip of its input frame for frame (one call each way)."""
    from tests.input_helpers import round_trip, run_session

    runner = Runner(bundle.pipeline, bundle.decoder, KVCacheManager(bundle.pipeline.kv_spec(), 1, "cpu"),
                    encoder=bundle.encoder)
    frames = np.random.default_rng(4).integers(0, 256, (21, 48, 64, 3), dtype=np.uint8)
    live = np.concatenate(run_session(runner, "live", "a red fox runs", blocks=2, live=frames, strength=0.0))
    expected = round_trip(bundle, frames)
    assert live.shape == expected.shape == frames.shape and np.abs(live.astype(int) - expected.astype(int)).max() <= 2


def test_a_decode_only_taehv_takes_pictures_through_the_models_own_vae(model_dir, tmp_path, make_client):
    """A TAEHV file with no encoder half decodes Wan latents only: the model directory's Wan VAE encodes the
    session's pictures and live input for it. At strength 0 the stream shows the VAE-encoded, TAEHV-decoded input
    frame for frame, as one call of each would."""
    from decoders.taehv import random_taehv
    from decoders.video_encode import WanStreamingEncoder

    directory = linked_model_dir(model_dir, tmp_path / "with-taehv")
    (directory / "taehv").mkdir()
    save_file(random_taehv(seed=1).state_dict(), str(directory / "taehv" / "taew2_1.safetensors"))
    config = EngineConfig(model_dir=directory, video_decoder="taehv", sink_frames=1, window_frames=2, **SMALL)
    bundle = build_models(config)
    assert isinstance(bundle.encoder, WanStreamingEncoder)
    _assert_live_at_strength_zero_is_the_round_trip(bundle)
    with make_client(engine={"model_dir": str(directory), "video_decoder": "taehv", "random_weights": False,
                             **{k: SMALL[k] for k in ("height", "width")}}) as client:
        with client.websocket_connect("/v1/stream") as ws:
            assert ws.receive_json()["type"] == "session"
            ws.receive_bytes()
            ws.send_json({"type": "live", "strength": 0.5, "id": "l"})
            answer = ws.receive_json()
            assert answer["type"] == "ack" and answer["of"] == "live", answer


def test_a_taehv_file_with_its_encoder_half_encodes_the_sessions_input(model_dir, tmp_path):
    """The published TAEHV files carry an encoder: with one, the model directory's TAEHV encodes pictures and live
    input too (no Wan VAE encoder state per session), and at strength 0 the stream is its round trip."""
    from decoders.taehv_encoder import TAEHVStreamingEncoder
    from tests.test_taehv_encoder_weights import WAN_TAEHV_ENCODER, published_state_dict, random_taehv_encoder

    directory = linked_model_dir(model_dir, tmp_path / "with-taehv-encoder")
    (directory / "taehv").mkdir()
    original = random_taehv_encoder(3, WAN_TAEHV_ENCODER)
    save_file(published_state_dict(original), str(directory / "taehv" / "taew2_1.safetensors"))
    config = EngineConfig(model_dir=directory, video_decoder="taehv", sink_frames=1, window_frames=2, **SMALL)
    assert config.resolved_video_encoder == "taehv"
    bundle = build_models(config)
    assert isinstance(bundle.encoder, TAEHVStreamingEncoder)
    assert all(torch.equal(bundle.encoder.model.state_dict()[key], value) for key, value in original.state_dict().items())
    _assert_live_at_strength_zero_is_the_round_trip(bundle)


def test_a_server_without_video_input_refuses_pictures_and_live_input_and_says_why(make_client):
    """``video_input`` off (the default under a GPU memory cap): no encoder, every picture and live input refused
    with the reason, everything else works."""
    from engine.api import Engine
    from engine.errors import InputUnsupported
    from tests.engine_helpers import small_config

    config = small_config(video_input=False)
    bundle = build_models(config)
    assert bundle.encoder is None

    async def scenario():
        engine = Engine(config, bundle=bundle)
        await engine.start()
        try:
            assert "video_input is off" in engine.input_refusal
            session = engine.create_session(seed=1)
            with pytest.raises(InputUnsupported, match="video_input is off"):
                engine.start_session(session.session_id, "a picture", context=np.zeros((1, 48, 64, 3), np.uint8))
            with pytest.raises(InputUnsupported):
                engine.set_live(session.session_id, 0.5)
            assert engine.start_session(session.session_id, "words only") == "active"  # everything else works
        finally:
            await engine.shutdown()

    import asyncio

    asyncio.run(scenario())
    with make_client(engine={"video_input": False}) as client:
        with client.websocket_connect("/v1/stream") as ws:
            assert ws.receive_json()["type"] == "session"
            ws.receive_bytes()
            ws.send_json({"type": "live", "strength": 0.5, "id": "l"})
            answer = ws.receive_json()
            assert answer["code"] == "input_unsupported" and "video_input is off" in answer["message"], answer
