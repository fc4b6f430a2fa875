"""A UMT5 text encoder of Wan's geometry with seeded random weights, for benchmarks of a model without weights.

With random DiT weights the engine otherwise pairs the 1.3B geometry with a byte embedding that costs nothing,
so a benchmark would leave out what a real Wan model pays for its text encoder: ~11 GB of weights and one
encode per new prompt. This builds that encoder — transformers' ``UMT5EncoderModel`` with UMT5-XXL's geometry
(Wan 2.1's ``text_encoder/config.json``) — without reading or fetching anything: constructed on the meta device
in the target dtype, then ``to_empty`` and in-place seeded draws scaled to keep 24 layers' activations in range.
Its tokenizer is word-level over a small built-in vocabulary (a word is one token; an unknown word is
``<unk>``): enough for the encoder's cost, which depends on the token count, not the words.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.models.loading import UMT5TextEncoder

# Wan 2.1's text encoder (google/umt5-xxl's encoder), as its config.json gives it.
UMT5_XXL = dict(
    vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
    dense_act_fn="gelu_new", is_gated_act=True, layer_norm_epsilon=1e-6, scalable_attention=True,
    tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, dropout_rate=0.0,
)
DRAW_CHUNK_ELEMENTS = 2**24  # rows drawn per generator
# The same code path at toy size (tests, and the text-encode bench on a CPU).
UMT5_TINY = {**UMT5_XXL, "vocab_size": 1000, "d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 4}

_WORDS = (
    "a an the of and in on at to with by from over under through near far above below into onto out up down "
    "red orange yellow green blue purple pink white black gray brown gold golden silver bright dark light "
    "fox dog cat bird horse fish whale deer wolf bear owl eagle butterfly dragon robot person woman man child "
    "city street road bridge tower lighthouse house castle forest tree trees flower flowers grass field "
    "mountain mountains hill valley river lake sea ocean beach wave waves cliff desert snow ice rain cloud "
    "clouds sky sun moon moonlight sunset sunrise night day morning evening star stars fire smoke water "
    "running walking flying swimming jumping dancing falling rising crashing glowing shining moving turning "
    "fresh cold warm hot old new small large big tiny huge slow fast calm wild quiet loud soft sharp "
    "cinematic hour shot close wide aerial view camera slow motion detailed realistic painting style "
    "benchmark warmup changed circle square triangle shape background"
).split()


def word_tokenizer(words: list[str] | tuple[str, ...] = _WORDS):
    """Word-level over ``words`` (split at whitespace, lower-cased), T5's conventions: ``<pad>`` = 0, ``</s>`` = 1
    after the tokens, ``<unk>`` = 2."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocabulary = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for word in words:
        vocabulary.setdefault(word, len(vocabulary))
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def random_umt5(geometry: dict, device: torch.device | str, dtype: torch.dtype, seed: int = 0):
    """``UMT5EncoderModel`` of ``geometry`` with seeded random weights, made on ``device`` directly."""
    from transformers import UMT5Config, UMT5EncoderModel

    device = torch.device(device)
    config = UMT5Config(**geometry)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = UMT5EncoderModel(config)
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device=device)
    # to_empty gives every parameter its own storage: tie the token embedding back (one table, as loaded).
    model.encoder.embed_tokens.weight = model.shared.weight
    draws = []  # (rows of a parameter, std): each drawn from its own generator, so threads may share the work
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.ndim == 1:  # RMS norm scales
                parameter.fill_(1.0)
                continue
            if "relative_attention_bias" in name:
                std = 0.1
            elif "embed" in name or "shared" in name:
                std = 1.0
            else:  # keeps activations in range through 24 layers
                std = parameter.shape[1] ** -0.5
            rows = max(1, DRAW_CHUNK_ELEMENTS // parameter.shape[1])
            draws.extend((parameter[start:start + rows], std) for start in range(0, parameter.shape[0], rows))

    def draw(index: int) -> None:
        part, std = draws[index]
        generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)
        with torch.no_grad():
            part.normal_(0.0, std, generator=generator)

    # CPU draws are serial per tensor: 5.7 B of them would take a minute on one core.
    workers = 1 if device.type == "cuda" else min(16, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="umt5-init") as pool:
        list(pool.map(draw, range(len(draws))))
    return model.eval()


def random_umt5_text_encoder(
    device: torch.device | str, dtype: torch.dtype, *, text_len: int, geometry: dict = UMT5_XXL, seed: int = 0,
    cuda_graphs: bool = False,
) -> UMT5TextEncoder:
    """The engine's UMT5 text encoder over :func:`random_umt5` and :func:`word_tokenizer`."""
    model = random_umt5(geometry, device, dtype, seed)
    return UMT5TextEncoder(model, word_tokenizer(), text_len=text_len, cuda_graphs=cuda_graphs)


def parameter_bytes(geometry: dict, dtype: torch.dtype) -> int:
    """Bytes of the encoder's weights in ``dtype``, counted on the meta device (nothing allocated)."""
    from transformers import UMT5Config, UMT5EncoderModel

    with torch.device("meta"):
        model = UMT5EncoderModel(UMT5Config(**geometry))
    element = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() for p in model.parameters()) * element
