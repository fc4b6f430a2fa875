"""The e4m3 format the FP8 linears quantize their rows to: its dtype, its largest finite value, and the floor of a
row's amax (a zero row keeps a finite scale and quantizes to zeros). One home for the eager quantizer
(``fp8_linear``) and the Triton one (``gelu_quantize``), which must agree on them."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# A zero row (or output channel) gets this amax instead of 0: its scale stays finite and its values quantize to 0.
AMAX_FLOOR = 1e-12
