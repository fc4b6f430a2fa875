"""A Triton kernel compiled for Hopper (sm_90) without a GPU, held to the rules every quantizing kernel of the
engine meets: no local memory (no register spills, no stack) and, where it writes e4m3, Hopper's saturating
e4m3 conversion in its PTX."""

from __future__ import annotations


def compile_for_sm90_without_spills(fn, pointers: dict, constants: dict, unaligned: tuple[str, ...] = (),
                                    num_warps: int = 4, *, e4m3_cast: bool = True):
    """``fn`` (a ``@triton.jit`` function) compiled for sm_90 with ``pointers``' types, ``constants`` and every
    argument not in ``unaligned`` specialised as 16-divisible (bench/fp8_attention_gpu.py's ``_compile``);
    asserts the rules above and returns the compiled kernel."""
    from bench.fp8_attention_gpu import _compile, cubin_usage

    compiled = _compile(fn, pointers, constants, unaligned, num_warps, 1, 90)
    usage = cubin_usage(compiled)
    assert usage["local_bytes"] == 0 and usage["stack_bytes"] == 0, usage
    if e4m3_cast:
        assert "cvt.rn.satfinite.e4m3x2.f32" in compiled.asm["ptx"]
    return compiled
