"""Training the tiny preset on the procedural world (see docs/TINY_MODEL.md): ``python -m train.run``."""
