"""Real models from a local directory: a diffusers-layout Wan2.1 T2V directory, optionally with causal weights.

A model directory (see docs/MODELS.md)::

    MODEL_DIR/
      transformer/    config.json [+ diffusion_pytorch_model*.safetensors unless causal weights replace them]
      vae/            config.json + diffusion_pytorch_model.safetensors          (AutoencoderKLWan)
      text_encoder/   config.json + model*.safetensors                           (UMT5EncoderModel)
      tokenizer/      tokenizer.json / tokenizer_config.json ...                 (AutoTokenizer)
      arstream.json   optional: sink/window/steps/shift/... for this model (explicit settings win)

Causal (distilled, block-causal) DiT weights as Self-Forcing and CausVid publish them are in the original
Wan format: a state dict, possibly under ``generator_ema`` / ``generator``, with or without a ``model.``
prefix. Their names are mapped with diffusers' own ``convert_wan_transformer_to_diffusers``; this module
never spells out the key map. ``.safetensors`` is preferred; ``.pt`` is only read with
``torch.load(weights_only=True)``.

Nothing is downloaded: every ``from_pretrained`` call is ``local_files_only`` and safetensors-only (no
pickled ``.bin`` fallback). Every failure is a :class:`ModelLoadError` naming the file or key.
"""

from __future__ import annotations

import html
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.models.dtypes import cast_keeping_fp32_modules
from engine.models.text_graphs import GraphedTextEncoder

if TYPE_CHECKING:
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

log = logging.getLogger("arstream.models")

MODEL_SETTINGS_FILE = "arstream.json"
# arstream.json keys: EngineConfig fields a model directory may set (explicit settings win).
MODEL_SETTINGS_KEYS = frozenset(
    {"sink_frames", "window_frames", "frames_per_block", "timesteps", "shift", "height", "width", "fps", "causal_weights"}
)
TEXT_ENCODER_MAX_TOKENS = 512
# Sub-dicts of a training checkpoint that hold the generator, in order of preference (EMA first, as
# Self-Forcing's and CausVid's inference scripts use it).
CAUSAL_WEIGHT_WRAPPERS = ("generator_ema", "generator")
# Prefixes training wrappers put in front of every key (stripped only when every key has one).
CAUSAL_WEIGHT_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.", "module.", "_orig_mod.")
TORCH_PICKLE_SUFFIXES = (".pt", ".pth", ".bin")
_SHOWN_KEYS = 6


class ModelLoadError(ValueError):
    """A model directory or weights file that cannot be loaded; the message names the file or key.

    A ``ValueError``, so a bad ``arstream.json`` read while validating an ``EngineConfig`` surfaces as
    that config's validation error.
    """


# --- arstream.json -----------------------------------------------------------------------------------


def read_model_settings(model_dir: str | Path) -> dict[str, Any]:
    """The model directory's ``arstream.json`` (``{}`` when it has none), keys checked.

    A relative ``causal_weights`` is resolved against the model directory. Value types are
    checked by :class:`~engine.config.EngineConfig`, which merges these under explicit settings.
    """
    path = Path(model_dir) / MODEL_SETTINGS_FILE
    if not path.is_file():
        return {}
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"{path}: cannot be read as JSON ({error})") from error
    if not isinstance(values, dict):
        raise ModelLoadError(f"{path}: must hold a JSON object, got {type(values).__name__}")
    unknown = sorted(set(values) - MODEL_SETTINGS_KEYS)
    if unknown:
        raise ModelLoadError(f"{path}: unknown key(s) {unknown}; known keys: {sorted(MODEL_SETTINGS_KEYS)}")
    weights = values.get("causal_weights")
    if weights is not None:
        if not isinstance(weights, str) or not weights:
            raise ModelLoadError(f"{path}: causal_weights must be a file path (string)")
        weights_path = Path(weights)
        values["causal_weights"] = str(weights_path if weights_path.is_absolute() else Path(model_dir) / weights_path)
    return values


def with_model_settings(data: dict[str, Any]) -> dict[str, Any]:
    """Raw ``EngineConfig`` input with the model directory's settings filled in where none was given.

    Precedence: a field given explicitly (not ``None``) > ``arstream.json`` > the field's default.
    """
    model_dir = Path(data["model_dir"])
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir}: no such directory")
    merged = dict(data)
    for key, value in read_model_settings(model_dir).items():
        if merged.get(key) is None:
            merged[key] = value
    return merged


# --- the whole directory ---------------------------------------------------------------------------


@dataclass
class LoadedModels:
    """The modules of a model directory, on the config's device, in its dtype, in eval mode."""

    transformer: "WanTransformer3DModel"
    vae: "AutoencoderKLWan"
    text_encoder: "UMT5TextEncoder"


def load_model_dir(
    model_dir: str | Path,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    causal_weights: str | Path | None = None,
    text_len: int = TEXT_ENCODER_MAX_TOKENS,
    text_encoder_graphs: bool = False,
    text_encoder_device: torch.device | str | None = None,
) -> LoadedModels:
    """Load ``model_dir`` (and ``causal_weights`` in place of its transformer weights) for ``device`` / ``dtype``;
    ``text_encoder_graphs``: CUDA graphs for the text encoder (on a CUDA device); ``text_encoder_device``: where
    the text encoder runs (default ``device``; the CPU keeps its weights off a small GPU)."""
    model_dir = Path(model_dir)
    device = torch.device(device)
    text_device = device if text_encoder_device is None else torch.device(text_encoder_device)
    check_device_dtype(device, dtype)
    configs = check_model_dir(model_dir)
    transformer = load_transformer(model_dir, dtype, causal_weights)
    vae = load_vae(model_dir, dtype)
    text_encoder = load_text_encoder(model_dir, dtype, text_device, text_len=text_len, cuda_graphs=text_encoder_graphs)
    log.info(
        "model directory loaded",
        extra={
            "model_dir": str(model_dir),
            "causal_weights": str(causal_weights) if causal_weights else None,
            "layers": configs["transformer"].get("num_layers"),
            "dtype": str(dtype).removeprefix("torch."),
        },
    )
    return LoadedModels(transformer.to(device).eval(), vae.to(device).eval(), text_encoder)


def check_device_dtype(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a device/dtype pair the machine cannot run, before anything is read."""
    if device.type == "cpu" and dtype not in (torch.float32, torch.bfloat16):
        raise ModelLoadError(f"dtype {dtype} is not supported on the CPU; use float32 or bfloat16 there")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {device} requested, but this machine has no usable CUDA device")
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise ModelLoadError(f"dtype bfloat16 is not supported by {torch.cuda.get_device_name(device)}; use float16")


def check_model_dir(model_dir: Path) -> dict[str, dict[str, Any]]:
    """Every part is there and the parts fit each other; returns the parts' config.json contents.

    Checked from the small config files, before any weights are read.
    """
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir}: no such directory")
    configs = {}
    for part in ("transformer", "vae", "text_encoder"):
        path = model_dir / part / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: missing (a diffusers-layout model directory has {part}/config.json)")
        try:
            configs[part] = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ModelLoadError(f"{path}: cannot be read as JSON ({error})") from error
    if not (model_dir / "tokenizer").is_dir():
        raise ModelLoadError(f"{model_dir / 'tokenizer'}: missing (the text encoder's tokenizer directory)")
    dit, vae, text = configs["transformer"], configs["vae"], configs["text_encoder"]
    where = model_dir / "transformer" / "config.json"
    if dit.get("image_dim") is not None or dit.get("added_kv_proj_dim") is not None:
        raise ModelLoadError(f"{where}: an image-conditioned Wan model; the causal pipeline runs text-to-video only")
    patch = dit.get("patch_size", [1, 2, 2])
    if list(patch)[0] != 1:
        raise ModelLoadError(f"{where}: temporal patch size {patch[0]}; causal streaming needs 1")
    text_dim, d_model = dit.get("text_dim", 4096), text.get("d_model")
    if d_model != text_dim:
        raise ModelLoadError(
            f"{model_dir / 'text_encoder' / 'config.json'}: d_model {d_model} does not match the transformer's "
            f"text_dim {text_dim} ({where})"
        )
    z_dim, channels = vae.get("z_dim", 16), dit.get("in_channels", 16)
    if z_dim != channels or dit.get("out_channels", channels) != channels:
        raise ModelLoadError(
            f"{model_dir / 'vae' / 'config.json'}: z_dim {z_dim} does not match the transformer's "
            f"in/out channels {channels}/{dit.get('out_channels')} ({where})"
        )
    return configs


def _check_loading_info(info: dict[str, Any], where: Path) -> None:
    """diffusers/transformers only warn about missing and unused weights; here both are errors."""
    problems = []
    for name, label in (("missing_keys", "missing"), ("unexpected_keys", "unknown"), ("mismatched_keys", "wrong shape")):
        keys = sorted(str(key) for key in info.get(name) or ())
        if keys:
            problems.append(f"{len(keys)} {label} key(s): {_show(keys)}")
    if info.get("error_msgs"):
        problems.append("; ".join(str(message) for message in info["error_msgs"]))
    if problems:
        raise ModelLoadError(f"{where}: " + "; ".join(problems))


def _show(keys: list[str]) -> str:
    shown = ", ".join(keys[:_SHOWN_KEYS])
    return shown + (f" (+{len(keys) - _SHOWN_KEYS} more)" if len(keys) > _SHOWN_KEYS else "")


# --- transformer --------------------------------------------------------------------------------------


def load_transformer(
    model_dir: str | Path, dtype: torch.dtype, causal_weights: str | Path | None = None
) -> "WanTransformer3DModel":
    """The DiT on the CPU in ``dtype`` (diffusers' fp32 modules kept fp32).

    Without ``causal_weights``: ``transformer/``'s own weights. With them: ``transformer/config.json``
    builds the module and the causal weights fill it (``transformer/``'s weights are not read).
    """
    from diffusers import WanTransformer3DModel

    model_dir = Path(model_dir)
    where = model_dir / "transformer"
    if causal_weights is not None:
        try:
            config = WanTransformer3DModel.load_config(model_dir, subfolder="transformer", local_files_only=True)
            transformer = _empty_transformer(config)
        except Exception as error:
            raise ModelLoadError(f"{where / 'config.json'}: {error}") from error
        load_causal_weights(transformer, causal_weights)
        return cast_keeping_fp32_modules(transformer, dtype).eval()
    return _from_pretrained(WanTransformer3DModel, model_dir, "transformer", torch_dtype=dtype)


def _from_pretrained(model_class, model_dir: str | Path, subfolder: str, **dtype_argument):
    """A diffusers or transformers model from ``model_dir/subfolder``: local safetensors only, every key
    accounted for. ``dtype_argument``: ``torch_dtype=`` for diffusers, ``dtype=`` for transformers."""
    where = Path(model_dir) / subfolder
    try:
        model, info = model_class.from_pretrained(
            model_dir,
            subfolder=subfolder,
            local_files_only=True,
            use_safetensors=True,
            output_loading_info=True,
            **dtype_argument,
        )
    except Exception as error:
        raise ModelLoadError(f"{where}: {error}") from error
    _check_loading_info(info, where)
    return model.eval()


def _empty_transformer(config: dict[str, Any]) -> "WanTransformer3DModel":
    """The module with parameters on the meta device (no random init of a 1.3B model); buffers are real."""
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    with init_empty_weights(include_buffers=False):
        return WanTransformer3DModel.from_config(config)


def load_causal_weights(transformer: "WanTransformer3DModel", path: str | Path) -> None:
    """Fill ``transformer`` (every parameter) from an original-format causal checkpoint, checked first."""
    path = Path(path)
    state_dict = read_causal_state_dict(path)
    converted, original_name = causal_state_dict_to_diffusers(state_dict)
    expected = transformer.state_dict()
    unknown = sorted(original_name[key] for key in set(converted) - set(expected))
    missing = sorted(set(expected) - set(converted))
    problems = []
    if unknown:
        problems.append(f"{len(unknown)} unknown key(s) {_show(unknown)}")
    if missing:
        problems.append(f"{len(missing)} missing key(s) (diffusers names) {_show(missing)}")
    if problems:
        raise ModelLoadError(
            f"{path}: does not fit the transformer of this model directory's config: " + "; ".join(problems)
        )
    weights = {}
    for key, target in expected.items():
        tensor = converted[key]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ModelLoadError(
                f"{path}: key {original_name[key]!r} (diffusers {key!r}) has shape {tuple(tensor.shape)}, "
                f"the transformer config expects {tuple(target.shape)}"
            )
        if not tensor.is_floating_point():
            raise ModelLoadError(f"{path}: key {original_name[key]!r} has dtype {tensor.dtype}, not a float type")
        weights[key] = tensor.to(torch.float32, copy=True)
    transformer.load_state_dict(weights, strict=True, assign=True)
    still_empty = [name for name, parameter in transformer.named_parameters() if parameter.is_meta]
    if still_empty:  # cannot happen after a strict load; keep a half-built model from running
        raise ModelLoadError(f"{path}: parameters left unset: {_show(still_empty)}")


def read_causal_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The generator's tensors of a causal checkpoint, with original (Wan) names.

    Takes ``generator_ema`` if the file has it, else ``generator``, else the whole file; then strips
    wrapper prefixes (``model.``, ``module.``, ...) that every key carries.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"causal weights {path}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt", device="cpu") as file:
                names = _select_generator(list(file.keys()), path)
                return {name: file.get_tensor(key) for name, key in names.items()}
        except ModelLoadError:
            raise
        except Exception as error:
            raise ModelLoadError(f"causal weights {path}: not a readable safetensors file ({error})") from error
    if suffix in TORCH_PICKLE_SUFFIXES:
        loaded = _torch_load(path)
        if not isinstance(loaded, dict):
            raise ModelLoadError(f"causal weights {path}: holds a {type(loaded).__name__}, not a state dict")
        flat = _flatten(loaded)
        names = _select_generator(list(flat), path)
        return {name: flat[key] for name, key in names.items()}
    raise ModelLoadError(
        f"causal weights {path}: unknown file type {suffix or '(none)'}; use .safetensors (preferred) or "
        f"{'/'.join(TORCH_PICKLE_SUFFIXES)}"
    )


def _torch_load(path: Path) -> Any:
    """``torch.load`` restricted to tensors and plain containers; memory-mapped where the format allows."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as mmap_error:
        if "weights_only" in str(mmap_error) or "Unsupported global" in str(mmap_error):
            raise ModelLoadError(
                f"causal weights {path}: refused by torch.load(weights_only=True): it holds more than tensors "
                f"({mmap_error}); convert it to .safetensors"
            ) from mmap_error
    try:  # legacy (non-zip) files cannot be memory-mapped
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise ModelLoadError(
            f"causal weights {path}: cannot be read with torch.load(weights_only=True) ({error}); "
            "convert it to .safetensors"
        ) from error


def _flatten(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """Nested dicts of tensors -> ``{"a.b.c": tensor}``, the way safetensors files spell nesting."""
    flat: dict[str, torch.Tensor] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            flat[name] = value
        elif isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        # anything else (step counters, config dicts of scalars) is not a weight
    return flat


def _select_generator(keys: list[str], path: Path) -> dict[str, str]:
    """``{name without wrappers: key in the file}`` for the generator's tensors."""
    names = {key: key for key in keys}
    for wrapper in CAUSAL_WEIGHT_WRAPPERS:
        chosen = {key[len(wrapper) + 1 :]: key for key in keys if key.startswith(wrapper + ".")}
        if chosen:
            names = chosen
            break
    stripped = True
    while stripped and names:
        stripped = False
        for prefix in CAUSAL_WEIGHT_PREFIXES:
            if all(name.startswith(prefix) for name in names):
                names = {name[len(prefix) :]: key for name, key in names.items()}
                stripped = True
                break
    if not names:
        raise ModelLoadError(f"causal weights {path}: holds no tensors")
    return names


def _is_diffusers_named(keys) -> bool:
    return any(key.startswith("condition_embedder.") or ".attn1." in key or ".attn2." in key for key in keys)


def causal_state_dict_to_diffusers(
    state_dict: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Original Wan names -> diffusers names with diffusers' own converter.

    Returns the converted state dict and, for error messages, each diffusers name's original name.
    A state dict already in diffusers names is passed through (converting it again would swap norm2
    and norm3).
    """
    if _is_diffusers_named(state_dict):
        return dict(state_dict), {key: key for key in state_dict}
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    # The converter renames keys and keeps the tensor objects, so identity recovers the original names.
    origin = {id(tensor): key for key, tensor in state_dict.items()}
    converted = convert_wan_transformer_to_diffusers(dict(state_dict))
    return converted, {key: origin.get(id(tensor), key) for key, tensor in converted.items()}


# --- VAE ------------------------------------------------------------------------------------------------


def load_vae(model_dir: str | Path, dtype: torch.dtype) -> "AutoencoderKLWan":
    from diffusers import AutoencoderKLWan

    return _from_pretrained(AutoencoderKLWan, model_dir, "vae", torch_dtype=dtype)


# --- text encoder ---------------------------------------------------------------------------------------


def clean_prompt(text: str) -> str:
    """The prompt cleaning of Wan's T5 tokenizer and diffusers' WanPipeline: ftfy (when installed),
    HTML unescape twice, whitespace runs to one space."""
    try:
        import ftfy
    except ImportError:
        ftfy = None
    if ftfy is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


class UMT5TextEncoder:
    """Wan's text conditioning: UMT5 encoder states of the prompt's tokens, zero-padded to ``text_len``.

    As Wan and diffusers' WanPipeline do: tokens (with ``</s>``) encoded with the attention mask, states
    after the prompt's tokens replaced by zeros, ``text_len`` rows in all. Prompts longer than
    ``text_len`` tokens are truncated to their first ``text_len - 1`` tokens + ``</s>`` (the
    tokenizer's truncation, which the checkpoints were trained with), with a warning in the log.

    The encoder runs on the prompts' tokens only (padded to the longest prompt of the call), not on
    ``text_len`` positions: the mask gives padding zero attention weight and every other op is per
    token, so the prompt's states are the same function; padding to 512 only cost time (docs/BENCHMARKS.md).
    ``encode_padded`` is Wan's call, the reference.
    """

    def __init__(self, model, tokenizer, text_len: int = TEXT_ENCODER_MAX_TOKENS, *, cuda_graphs: bool = False) -> None:
        """``cuda_graphs``: on a CUDA device, one prompt's encode replays a graph (engine/models/text_graphs.py)."""
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.tokenizer.padding_side = "right"  # zeros go after the tokens
        self.text_len = text_len
        self.text_dim = int(model.config.d_model)
        self.graphed = GraphedTextEncoder(self._states, text_len, self.device) if cuda_graphs else None

    def _states(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask).last_hidden_state

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def unknown_words(self, prompt: str) -> None:
        return None  # a subword tokenizer reads any text

    def encode(self, prompts: list[str]) -> torch.Tensor:
        """``[len(prompts), text_len, text_dim]`` float32 on the CPU, zero after each prompt's tokens."""
        return self._encode(prompts, padding="longest")

    def encode_padded(self, prompts: list[str]) -> torch.Tensor:
        """The same, with the encoder run on all ``text_len`` positions (Wan's own call; the reference)."""
        return self._encode(prompts, padding="max_length")

    @torch.no_grad()  # not inference_mode: the cached embeddings must stay ordinary tensors
    def _encode(self, prompts: list[str], padding: str) -> torch.Tensor:
        texts = [clean_prompt(prompt) for prompt in prompts]
        probe = self.tokenizer(texts, add_special_tokens=True, truncation=True, max_length=self.text_len + 1)
        too_long = sum(len(ids) > self.text_len for ids in probe["input_ids"])
        if too_long:  # never the text itself: prompts stay out of logs
            log.warning("prompt longer than the text encoder's tokens; truncated", extra={"max_tokens": self.text_len})
        tokens = self.tokenizer(
            texts,
            padding=padding,
            max_length=self.text_len,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        mask = tokens["attention_mask"]
        if self.graphed is not None and padding == "longest":
            states = self.graphed(tokens["input_ids"], mask)
        else:
            states = self._states(tokens["input_ids"].to(self.device), mask.to(self.device))
        states = states.float().cpu()
        out = torch.zeros(len(texts), self.text_len, self.text_dim)
        for row, length in enumerate(mask.sum(dim=1).tolist()):
            out[row, :length] = states[row, :length]
        return out


def load_text_encoder(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    text_len: int = TEXT_ENCODER_MAX_TOKENS,
    cuda_graphs: bool = False,
) -> UMT5TextEncoder:
    """``text_encoder/`` (UMT5 encoder) and ``tokenizer/`` through transformers, local files only."""
    from transformers import AutoTokenizer, UMT5EncoderModel

    model_dir = Path(model_dir)
    model = _from_pretrained(UMT5EncoderModel, model_dir, "text_encoder", dtype=dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, subfolder="tokenizer", local_files_only=True)
    except Exception as error:
        raise ModelLoadError(f"{model_dir / 'tokenizer'}: {error}") from error
    if tokenizer.pad_token_id is None:
        raise ModelLoadError(f"{model_dir / 'tokenizer'}: the tokenizer has no pad token")
    return UMT5TextEncoder(model.to(device), tokenizer, text_len=text_len, cuda_graphs=cuda_graphs)
