"""Two candidates' DiT files mixed weight by weight, without training: ``(1 - alpha) * A + alpha * B``.

    python -m train.soup A B --alpha 0.6 [--only attn1] --out DIR

Two rounds started from the same weights stay close enough that a point between them is a model too (a "model
soup"), and each part of the DiT may carry a different skill: session 24's two polished rounds differed in which
checks they kept, and the mix of one's self-attention into the other kept both sets (docs/TINY_MODEL.md).

``--only NAME[,NAME]``: mix only the transformer's tensors whose names contain one of these (``attn1`` is every
block's self-attention); every other tensor, and the other module files, are A's. Without it every floating tensor
of every DiT file both have is mixed. Integer tensors are copied from A (they must be equal in both).

Refused, naming what differs: files with other tensor names or shapes, and transformers trained with another
spatial rotary base (``rope_spatial_theta``; a mix of two bases is neither). The output keeps A's file metadata, so
``train.gate``, ``train.fade --weights`` and ``train.seam --install`` read it as they read A.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.models.trained import rope_spatial_theta

DIT_FILES = ("transformer", "audio_tokens", "text_encoder")


class SoupError(ValueError):
    """Two candidates that cannot be mixed, or a mixing request that names nothing."""


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(path, "pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}, dict(handle.metadata() or {})


def mix_file(a: Path, b: Path, alpha: float, only: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], dict[str, str], int]:
    """One module file of A mixed with B's: (tensors, A's metadata, how many tensors were mixed)."""
    tensors_a, meta_a = _read(a)
    tensors_b, _ = _read(b)
    if tensors_a.keys() != tensors_b.keys():
        differ = sorted(tensors_a.keys() ^ tensors_b.keys())
        raise SoupError(f"{a.name}: the candidates hold other tensors ({', '.join(differ[:4])}...)")
    if a.name == "transformer.safetensors" and (theta_a := rope_spatial_theta(a)) != (theta_b := rope_spatial_theta(b)):
        raise SoupError(f"{a.name}: spatial rotary bases differ ({theta_a:g} and {theta_b:g}): a mix would be neither")
    out, mixed = {}, 0
    for key, ta in tensors_a.items():
        tb = tensors_b[key]
        if ta.shape != tb.shape or ta.dtype != tb.dtype:
            raise SoupError(f"{a.name}: {key} is {tuple(ta.shape)} {ta.dtype} in A, {tuple(tb.shape)} {tb.dtype} in B")
        if not ta.is_floating_point():
            if not torch.equal(ta, tb):
                raise SoupError(f"{a.name}: {key} is an integer tensor that differs between the candidates")
            out[key] = ta
        elif only and not any(name in key for name in only):
            out[key] = ta
        else:
            out[key] = ((1.0 - alpha) * ta.float() + alpha * tb.float()).to(ta.dtype)
            mixed += 1
    return out, meta_a, mixed


def soup(a: Path, b: Path, alpha: float, out: Path, only: tuple[str, ...] = ()) -> dict[str, int]:
    """Write the mix of A's and B's DiT files to ``out``; the number of tensors mixed per file."""
    if not 0.0 <= alpha <= 1.0:
        raise SoupError(f"alpha must be in [0, 1], got {alpha}")
    present = [name for name in DIT_FILES if (a / f"{name}.safetensors").exists()]
    if "transformer" not in present or not (b / "transformer.safetensors").exists():
        raise SoupError("both candidates need a transformer.safetensors")
    mixes = {}  # every file mixed in memory first: a refusal leaves nothing half-written in ``out``
    for name in present:
        source_b = b / f"{name}.safetensors"
        if not source_b.exists():
            raise SoupError(f"{name}.safetensors is in A but not in B")
        if not (only and name != "transformer"):  # --only names the transformer's tensors: the other files are A's
            mixes[name] = mix_file(a / f"{name}.safetensors", source_b, alpha, only)
    if only and mixes["transformer"][2] == 0:
        raise SoupError(f"--only {','.join(only)}: no transformer tensor has such a name")
    out.mkdir(parents=True, exist_ok=True)
    for name in present:
        if name in mixes:
            tensors, metadata, _ = mixes[name]
            save_file(tensors, out / f"{name}.safetensors", metadata=metadata)
        else:
            shutil.copyfile(a / f"{name}.safetensors", out / f"{name}.safetensors")
    return {name: mixes[name][2] if name in mixes else 0 for name in present}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path, help="the candidate whose files and metadata the mix starts from")
    parser.add_argument("b", type=Path, help="the candidate mixed in")
    parser.add_argument("--alpha", type=float, required=True, help="B's share, 0..1")
    parser.add_argument("--only", default="", help="comma-separated name parts of the transformer tensors to mix")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    only = tuple(part for part in args.only.split(",") if part)
    try:
        counts = soup(args.a, args.b, args.alpha, args.out, only)
    except SoupError as error:
        print(f"train.soup: {error}", file=sys.stderr)
        return 2
    print(f"{args.out}: " + ", ".join(f"{name} {n} tensors mixed" for name, n in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
