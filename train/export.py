"""Copy a training checkpoint's module files into the shipped weights (engine/models/weights/tiny/).

    python -m train.export CKPT [--to engine/models/weights/tiny]

The checkpoint's files already have the shipped layout (engine.models.trained);
this checks each one loads into the preset's modules before copying it. A module
the checkpoint has no file for (e.g. the audio decoder, reused from the shipped
weights by ``train.run --init``) keeps the file already in the destination.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from engine.models.trained import WEIGHTS_ROOT, TrainedWeights
from train.common import MODULE_FILES, build_modules


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--to", type=Path, default=WEIGHTS_ROOT / "tiny")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as staging:
        staging = Path(staging)
        for name in MODULE_FILES:
            own = args.checkpoint / f"{name}.safetensors"
            source = own if own.exists() else args.to / f"{name}.safetensors"
            if not source.exists():
                raise FileNotFoundError(f"{name}: neither {own} nor {source} exists")
            shutil.copyfile(source, staging / f"{name}.safetensors")
            if source != own:
                print(f"{name}: not in the checkpoint, keeping {source}")
        weights = TrainedWeights(staging)
        modules = build_modules("cpu")
        weights.latent_stats()
        for name in MODULE_FILES:
            if name == "text_encoder":
                weights.text_encoder()
            else:
                weights.load(name, modules[name])
        args.to.mkdir(parents=True, exist_ok=True)
        for name in MODULE_FILES:
            shutil.copyfile(staging / f"{name}.safetensors", args.to / f"{name}.safetensors")
            print(f"{args.to / name}.safetensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
