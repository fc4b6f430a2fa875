"""A Triton kernel's launch, recorded from its own wrapper on CPU tensors and compiled for Hopper (sm_90) as
Triton's launcher would specialise it, without a GPU. It is held to the rules every quantizing kernel of the
engine meets: no local memory (no register spills, no stack) and, where it writes e4m3, Hopper's saturating e4m3
conversion in its PTX; and its global loads and stores are counted by width: a kernel whose offsets Triton
cannot prove 16-byte aligned moves each value with an instruction of its own."""

from __future__ import annotations

import re


class LaunchRecorder:
    """Stands in for a ``@triton.jit`` kernel in its module: ``kernel[grid](*args, **kwargs)`` records the launch
    instead of running it, so a wrapper called on CPU tensors yields the arguments it would launch with."""

    def __init__(self, fn):
        self.fn = fn
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def compile_as_launched(fn, args: tuple, kwargs: dict, arch: int = 90):
    """``fn`` compiled for sm_``arch`` with the specialisation Triton's launcher derives from these arguments
    (an int equal to 1 made a constant, ints and pointers divisible by 16 marked so, unless the kernel's
    ``do_not_specialize`` says otherwise): what a GPU launch with them would compile, without a GPU. It calls the
    launcher's own binder (Triton 3.6's internals, the version torch 2.13 brings: a Triton that moves them fails
    here loudly rather than compiling something else)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def global_accesses(compiled) -> dict[str, int]:
    """The PTX's global load and store instructions by width, e.g. ``{"ld.global.v4.b32": 4, "st.global.b8": 2}``
    (the cache and eviction qualifiers dropped)."""
    import collections

    found = re.findall(r"\b((?:ld|st)\.global)(?:\.\w+(?:::\w+)*)*?((?:\.v\d)?\.[bfsu]\d+)\b",
                       compiled.asm["ptx"])
    return dict(collections.Counter(op + width for op, width in found))


def record_launches(monkeypatch, module, name: str) -> LaunchRecorder:
    """``module.name`` (a kernel) replaced by a :class:`LaunchRecorder` for the test."""
    recorder = LaunchRecorder(getattr(module, name))
    monkeypatch.setattr(module, name, recorder)
    return recorder


def compile_launch_for_sm90(recorder: LaunchRecorder, index: int = 0, *, e4m3_cast: bool = True):
    """The recorder's ``index``-th launch compiled for sm_90 as launched (:func:`compile_as_launched`), held to
    the rules above; returns its :func:`global_accesses`."""
    from bench.fp8_attention_gpu import cubin_usage

    args, kwargs = recorder.launches[index]
    compiled = compile_as_launched(recorder.fn, args, kwargs)
    usage = cubin_usage(compiled)
    assert usage["local_bytes"] == 0 and usage["stack_bytes"] == 0, usage
    if e4m3_cast:
        assert "cvt.rn.satfinite.e4m3x2.f32" in compiled.asm["ptx"]
    return global_accesses(compiled)


def narrow_accesses(accesses: dict[str, int]) -> int:
    """How many of the global loads and stores move less than 16 bytes a thread."""
    narrow = 0
    for name, count in accesses.items():
        lanes, bits = re.search(r"(?:\.v(\d))?\.[bfsu](\d+)$", name).groups()
        narrow += count if int(lanes or 1) * int(bits) < 128 else 0
    return narrow
