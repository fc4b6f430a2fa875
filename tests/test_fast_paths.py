"""Fast paths of the block loop against the paths they replace, on the same weights and noise.

The history of a block is gathered (and its keys rotated) once per block into a
shared per-branch buffer; the reference gathers it from the pool in every
forward. Both must give the same latents past the window's first eviction, in
grouped and in interleaved stepwise execution, and across a recache.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.kv_cache import KVCacheManager
from engine.models.pipeline import CausalWanPipeline
from tests.engine_helpers import build_small

pytestmark = pytest.mark.background  # computes only: runs on the idle core (tests/background_pytest.py)

FLOAT32_TOLERANCE = 1e-5


def _pipelines(**overrides) -> tuple[CausalWanPipeline, CausalWanPipeline]:
    """(gathered-once, per-forward) pipelines over one transformer."""
    _, bundle = build_small(**overrides)
    fast = bundle.pipeline
    reference = fast.variant(gather_history_once=False)
    assert fast.context_kv and not reference.context_kv
    return fast, reference


def _session(pipeline: CausalWanPipeline, session_id: str, seed: int, prompt: str, manager=None):
    manager = manager or KVCacheManager(pipeline.kv_spec(), 2, "cpu")
    return manager, manager.open_session(session_id), pipeline.new_progress(seed=seed, prompt=prompt)


def _max_diff(a, b) -> float:
    return a.float().max_abs_diff(b.float())


def test_gathered_history_matches_per_forward_gather_past_eviction():
    fast, reference = _pipelines(sink_frames=3, window_frames=6)
    _, fast_kv, fast_progress = _session(fast, "s", 3, "a kite over dunes")
    _, ref_kv, ref_progress = _session(reference, "s", 3, "a kite over dunes")
    workspace = fast.context_kv["cond"]
    blocks = 12  # the window (6 frames) first evicts at block 4
    diffs = []
    for block in range(blocks):
        loads_before = workspace.loads
        diffs.append(_max_diff(fast.run_block(fast_kv, fast_progress), reference.run_block(ref_kv, ref_progress)))
        # One gather for the block's 4 denoising forwards and its commit pass (none before any history).
        assert workspace.loads - loads_before == 1
    assert fast_kv.committed_frames("cond") == 36 > 3 + 6
    assert max(diffs) <= FLOAT32_TOLERANCE, diffs


def test_interleaved_stepwise_sessions_reload_the_shared_buffer():
    """Two sessions stepped alternately share one buffer; each must still see only its own history."""
    fast, reference = _pipelines(sink_frames=3, window_frames=3)
    manager = KVCacheManager(fast.kv_spec(), 2, "cpu")
    sessions = [_session(fast, name, seed, prompt, manager)[1:] for name, seed, prompt in
                (("a", 1, "red sky"), ("b", 2, "green sea"))]
    interleaved = {0: [], 1: []}
    loads_before = fast.context_kv["cond"].loads
    for _ in range(5 * (fast.num_steps + 1)):  # 5 blocks each, one forward per call, alternating
        for index, (kv, progress) in enumerate(sessions):
            clean = fast.step(kv, progress)
            if clean is not None:
                interleaved[index].append(clean)
    # Every forward found the other session's history loaded, and gathered its own again.
    assert fast.context_kv["cond"].loads - loads_before == 2 * 5 * (fast.num_steps + 1)
    for index, (name, seed, prompt) in enumerate((("a", 1, "red sky"), ("b", 2, "green sea"))):
        _, kv, progress = _session(reference, name, seed, prompt)
        alone = [reference.run_block(kv, progress) for _ in range(5)]
        assert max(_max_diff(a, b) for a, b in zip(interleaved[index], alone)) <= FLOAT32_TOLERANCE


@pytest.mark.parametrize("policy", ["soft", "recache"])
def test_prompt_change_with_gathered_history_matches_per_forward(policy):
    fast, reference = _pipelines(sink_frames=3, window_frames=6)
    outputs = []
    for pipeline in (fast, reference):
        _, kv, progress = _session(pipeline, "s", 5, "a quiet pond")
        blocks = [pipeline.run_block(kv, progress) for _ in range(4)]
        pipeline.set_prompt(kv, progress, "a stormy pond", "", policy)
        blocks += [pipeline.run_block(kv, progress) for _ in range(3)]
        outputs.append(blocks)
    assert max(_max_diff(a, b) for a, b in zip(*outputs)) <= FLOAT32_TOLERANCE
    # The recache wrote resident blocks in place: the next block must not reuse a stale gather.
    before_change = outputs[0][3]
    assert _max_diff(outputs[0][4], before_change) > 0


def test_gathered_buffer_is_sized_to_the_whole_context():
    fast, _ = _pipelines(sink_frames=3, window_frames=6)
    spec = fast.kv_spec()
    workspace = fast.context_kv["cond"]
    assert workspace.nbytes == spec.context_frames * spec.block_bytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_forwards_match_eager_forwards():
    """Replayed graphs compute what the eager forwards compute (float32, past the first eviction)."""
    _, bundle = build_small(device="cuda", sink_frames=3, window_frames=3, cuda_graphs=True)
    fast = bundle.pipeline
    eager = fast.variant(gather_history_once=True, cuda_graphs=False)
    outputs = []
    for pipeline in (fast, eager):
        manager = KVCacheManager(pipeline.kv_spec(), 1, "cuda")
        kv, progress = manager.open_session("s"), pipeline.new_progress(seed=2, prompt="a reef")
        outputs.append([pipeline.run_block(kv, progress) for _ in range(6)])
    assert fast.forwards.num_graphs > 0 and fast.forwards.replays > 0
    assert max(_max_diff(a, b) for a, b in zip(*outputs)) <= FLOAT32_TOLERANCE


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_graphs_captured_with_one_kernel_set_are_not_replayed_after_the_set_is_swapped():
    """Swapping the transformer's kernels (as benchmarks do) drops the graphs: the next forwards capture anew."""
    from engine.models.kernels import EAGER_KERNELS

    _, bundle = build_small(device="cuda", sink_frames=3, window_frames=3, cuda_graphs=True)
    pipeline = bundle.pipeline
    manager = KVCacheManager(pipeline.kv_spec(), 1, "cuda")
    kv, progress = manager.open_session("s"), pipeline.new_progress(seed=2, prompt="a reef")
    pipeline.run_block(kv, progress)
    fused_graphs = list(pipeline.forwards.graphs.entries())
    assert fused_graphs
    pipeline.transformer.kernels = EAGER_KERNELS
    pipeline.run_block(kv, progress)
    eager_graphs = list(pipeline.forwards.graphs.entries())
    assert eager_graphs and pipeline.forwards.kernels is EAGER_KERNELS  # captured again, with the eager set
    assert not any(graph is old for graph in eager_graphs for old in fused_graphs)


@pytest.mark.skipif(shutil.which("g++") is None, reason="Inductor's CPU backend needs a C++ compiler")
def test_compiled_kernels_round_as_their_eager_reference_in_bf16():
    """The fused kernels (compiled on CUDA in the service) match the eager functions in bf16 to ~1e-5, not
    ~3e-3: Inductor is told to round where eager rounds. Checked here through Inductor's CPU backend."""
    from engine.models import kernels

    generator = torch.Generator().manual_seed(0)
    heads, head_dim, seq = 4, 32, 96
    x = (3 * torch.randn(1, seq, heads * head_dim, generator=generator)).bfloat16()
    weight = (1 + 0.1 * torch.randn(heads * head_dim, generator=generator)).bfloat16()
    angles = torch.randn(seq, 1, head_dim // 2, generator=generator)
    update = torch.randn(1, seq, heads * head_dim, generator=generator).bfloat16()
    scale, shift = (0.1 * torch.randn(2, 1, 2, 1, heads * head_dim, generator=generator)).unbind(0)
    cases = {
        kernels.rms_norm_rotate: (x, weight, 1e-6, heads, angles.cos(), angles.sin()),
        kernels.residual_modulated_layer_norm: (x, update, scale, shift, 1e-6),
    }
    for fn, args in cases.items():
        eager = fn(*args)
        fused = kernels.compile_kernel(fn)(*args)
        for e, f in zip(eager if isinstance(eager, tuple) else (eager,), fused if isinstance(fused, tuple) else (fused,)):
            assert f.dtype == e.dtype == torch.bfloat16
            error = float((f.float() - e.float()).norm() / e.float().norm())
            assert error < 1e-4, (fn.__name__, error)


@pytest.mark.skipif(shutil.which("g++") is None, reason="Inductor's CPU backend needs a C++ compiler")
def test_engine_kernels_with_norms_apart_compute_the_eager_functions_bit_for_bit(monkeypatch):
    """The engine's kernel set (norms on torch's kernels, the elementwise work between them compiled) gives
    exactly the eager functions' bf16 results: each step through Inductor's CPU backend vs its reference."""
    from engine.models import kernels

    monkeypatch.setattr(kernels.DeviceKernel, "compile_on_cpu", True)
    generator = torch.Generator().manual_seed(1)
    heads, head_dim, seq, frames = 4, 32, 96, 2
    dim = heads * head_dim
    x = (3 * torch.randn(1, seq, dim, generator=generator)).bfloat16()
    update = torch.randn(1, seq, dim, generator=generator).bfloat16()
    weight = (1 + 0.1 * torch.randn(dim, generator=generator)).bfloat16()
    bias = (0.1 * torch.randn(dim, generator=generator)).bfloat16()
    scale, shift = (0.1 * torch.randn(2, 1, frames, 1, dim, generator=generator)).unbind(0)
    # Row slices of bigger tables, as the rotary module's are: the rotation then reads interleaved copies.
    angles = torch.randn(seq + 40, 1, head_dim // 2, generator=generator)
    cos, sin = angles.cos()[40:], angles.sin()[40:]
    args = {
        "modulated_layer_norm": (x, scale, shift, 1e-6),
        "gated_residual": (x, update, scale),
        "affine_layer_norm": (x, weight, bias, 1e-6),
        "residual_modulated_layer_norm": (x, update, scale, shift, 1e-6),
        "rms_norm": (x, weight, 1e-6),
        "rotate_pairs": (x.unflatten(-1, (heads, -1)), cos, sin),
        "rms_norm_rotate": (x, weight, 1e-6, heads, cos, sin),
    }
    engine_set = kernels.Kernels.make(True)
    assert engine_set.fused and not engine_set.fuse_norms
    for name, inputs in args.items():
        expected = getattr(kernels.EAGER_KERNELS, name)(*inputs)
        got = getattr(engine_set, name)(*inputs)
        for e, g in zip(expected if isinstance(expected, tuple) else (expected,), got if isinstance(got, tuple) else (got,)):
            assert g.dtype == e.dtype == torch.bfloat16, name
            assert torch.equal(g, e), (name, float((g.float() - e.float()).abs().max()))
    compiled = [kernels._FUSED_NORMALIZE_MODULATE, kernels._FUSED_ROTATE_INTERLEAVED, kernels._FUSED_GATED_RESIDUAL,
                kernels._FUSED_NORMALIZE_AFFINE]
    assert all(k._compiled is not None and not k._failed for k in compiled)  # the compiled path ran, not the fallback


def test_feed_forward_through_the_kernels_is_diffusers_feed_forward():
    """The FFN's first half goes through ``kernels.gelu_linear`` only for diffusers' own layout (tanh GELU
    projection, dropout, linear) in eval mode; on the CPU every set runs it eagerly: bit for bit the module."""
    from diffusers.models.attention import FeedForward

    from engine.models import kernels
    from engine.models.causal_wan import _feed_forward

    torch.manual_seed(3)
    x = torch.randn(1, 40, 64).bfloat16()
    for activation in ("gelu-approximate", "gelu"):  # tanh: through the kernels; erf: the module's own path
        ffn = FeedForward(64, inner_dim=96, activation_fn=activation).bfloat16().eval()
        with torch.no_grad():
            expected = ffn(x)
            for kernel_set in (kernels.EAGER_KERNELS, kernels.Kernels.make(True)):
                assert torch.equal(_feed_forward(ffn, x, kernel_set), expected), activation
        assert (activation == "gelu-approximate") == (ffn.net[0].approximate == "tanh")


def test_the_bf16_engine_keeps_exact_kernels_and_the_fp8_modes_take_the_gelu_epilogue():
    """``exact`` (bf16's default) leaves the GELU out of the matrix product's epilogue, which rounds once where
    eager rounds twice; the FP8 modes, measured against bf16 by their quality delta, take it."""
    from engine.models import kernels

    assert kernels.Kernels.make(True).exact and kernels.Kernels.make(True).gelu_linear is kernels.gelu_linear
    inexact = kernels.Kernels.make(True, exact=False)
    assert not inexact.exact and inexact.gelu_linear is kernels._gelu_linear_epilogue
    _, bundle = build_small()
    assert bundle.pipeline.transformer.exact_kernels
    _, bundle = build_small(dtype="bfloat16", fp8="linear")
    assert not bundle.pipeline.transformer.exact_kernels


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="norm2's Triton pass runs on CUDA")
@pytest.mark.parametrize("rows", [4680, 1560, 97])
def test_norm2_from_statistics_is_torchs_affine_layer_norm_bit_for_bit(rows):
    """norm2 finished from the bf16 rows' statistics with torch's own multiply-add: the same bits as the eager
    float32 layer norm with weights, on weights and biases far from 1 and 0 (the random model's are 1 and 0,
    which no rounding order can tell apart)."""
    from engine.models import kernels

    generator = torch.Generator(device="cuda").manual_seed(rows)
    x = (3 * torch.randn(1, rows, 1536, device="cuda", generator=generator) + 0.5).bfloat16()
    weight = (1 + 0.2 * torch.randn(1536, device="cuda", generator=generator)).bfloat16()
    bias = (0.2 * torch.randn(1536, device="cuda", generator=generator)).bfloat16()
    expected = kernels.EAGER_KERNELS.affine_layer_norm(x, weight, bias, 1e-6)
    assert torch.equal(kernels.Kernels.make(True).affine_layer_norm(x, weight, bias, 1e-6), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GELU epilogue runs on CUDA")
@pytest.mark.parametrize("rows", [4680, 1560, 96])
def test_gelu_epilogue_is_the_tanh_gelu_of_the_unrounded_product(rows):
    """cuBLASLt's GELU epilogue (``torch._addmm_activation`` on CUDA) is the tanh approximation, applied to the
    float32 product: against float32 math it is at least as close as eager (which rounds before the GELU),
    and much closer to tanh than to the exact erf GELU."""
    from engine.models import kernels

    generator = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(1, rows, 1536, device="cuda", generator=generator).bfloat16()
    weight = (torch.randn(8960, 1536, device="cuda", generator=generator) / 40).bfloat16()
    bias = (0.1 * torch.randn(8960, device="cuda", generator=generator)).bfloat16()
    fused = kernels.Kernels.make(True, exact=False).gelu_linear(x, weight, bias)
    eager = kernels.EAGER_KERNELS.gelu_linear(x, weight, bias)
    product = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    tanh32 = torch.nn.functional.gelu(product, approximate="tanh")
    erf32 = torch.nn.functional.gelu(product)

    def rel(a, b):
        return float((a.float() - b).norm() / b.norm())

    assert fused.shape == eager.shape and fused.dtype == torch.bfloat16
    assert rel(fused, tanh32) <= rel(eager, tanh32) * 1.05
    assert rel(fused, tanh32) < 4e-3 and rel(fused, eager) < 8e-3
    # Which GELU: in float32 (no bf16 rounding to hide the ~1e-4 between the two forms).
    fused32 = kernels.Kernels.make(True, exact=False).gelu_linear(x.float(), weight.float(), bias.float())
    assert rel(fused32, tanh32) < 2e-5 < 3e-5 < rel(fused32, erf32)


@pytest.mark.skipif(shutil.which("g++") is None, reason="Inductor's CPU backend needs a C++ compiler")
def test_fused_kernels_compile_nothing_for_a_second_session(monkeypatch):
    """Automatic dynamic shapes: once one session has met every shape (first block, growing history, eviction,
    recache), a second session compiles nothing — the warm-up's promise that no viewer waits for a compile."""
    from torch._dynamo.utils import counters

    from engine.models import kernels

    monkeypatch.setattr(kernels.DeviceKernel, "compile_on_cpu", True)
    _, bundle = build_small(sink_frames=1, window_frames=4)
    pipeline = bundle.pipeline
    pipeline.transformer.kernels = kernels.Kernels.make(True)
    manager = KVCacheManager(pipeline.kv_spec(), 1, "cpu")

    def session(name: str, blocks: int) -> None:
        kv, progress = manager.open_session(name), pipeline.new_progress(seed=1, prompt="a reef")
        for _ in range(blocks):
            pipeline.run_block(kv, progress)
        pipeline.recache(kv, progress)
        pipeline.run_block(kv, progress)
        kv.close()

    session("warm-up", 4)
    compiled = counters["stats"]["unique_graphs"]
    session("viewer", 6)
    assert counters["stats"]["unique_graphs"] == compiled
    assert kernels._FUSED_NORMALIZE_MODULATE._compiled is not None and not kernels._FUSED_NORMALIZE_MODULATE._failed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the bf16 layer-norm statistics path runs on CUDA")
@pytest.mark.parametrize("rows,dim", [(4680, 1536), (1560, 1536), (96, 128)])
def test_layer_norm_statistics_of_bf16_rows_are_those_of_their_float32_copy(rows, dim):
    """The engine's modulated layer norm takes torch's statistics of the bf16 rows (no float32 copy): they
    must be the very statistics the eager path's float32 layer norm computes, so the result is bit-identical."""
    from engine.models import kernels

    generator = torch.Generator(device="cuda").manual_seed(rows)
    x = (3 * torch.randn(1, rows, dim, device="cuda", generator=generator) + 0.5).bfloat16()
    scale, shift = (0.1 * torch.randn(2, 1, 3, 1, dim, device="cuda", generator=generator)).unbind(0)
    x = x[:, : rows - rows % 3]
    mean, rstd = kernels.layer_norm_stats(x, 1e-6)
    _, mean32, rstd32 = torch.native_layer_norm(x.float(), (dim,), None, None, 1e-6)
    assert mean.dtype == rstd.dtype == torch.float32
    assert torch.equal(mean, mean32) and torch.equal(rstd, rstd32)
    expected = kernels.EAGER_KERNELS.modulated_layer_norm(x, scale, shift, 1e-6)
    assert torch.equal(kernels.Kernels.make(True).modulated_layer_norm(x, scale, shift, 1e-6), expected)


@pytest.mark.skipif(shutil.which("g++") is None, reason="Inductor's CPU backend needs a C++ compiler")
def test_forgetting_compiled_kernels_compiles_them_again_for_the_next_sizes(monkeypatch):
    """Benchmarks that build two model sizes in one process drop the first one's compiled kernels, so the
    second is compiled for its own sizes (not served by a kernel made dynamic in them)."""
    from engine.models import kernels

    monkeypatch.setattr(kernels.DeviceKernel, "compile_on_cpu", True)
    x = torch.randn(1, 2, 8, 16)
    gate = torch.randn(1, 2, 1, 16)
    kernels._FUSED_GATED_RESIDUAL(x, x, gate)
    first = kernels._FUSED_GATED_RESIDUAL._compiled
    assert first is not None
    kernels.DeviceKernel.forget_compiled()
    assert kernels._FUSED_GATED_RESIDUAL._compiled is None
    y = torch.randn(1, 2, 4, 32)
    out = kernels._FUSED_GATED_RESIDUAL(y, y, torch.randn(1, 2, 1, 32))
    assert kernels._FUSED_GATED_RESIDUAL._compiled is not None and kernels._FUSED_GATED_RESIDUAL._compiled is not first
    assert out.shape == y.shape


def test_the_shared_buffer_does_not_keep_a_finished_sessions_pool_alive():
    """The engine sizes its session pools after a probe session's manager is dropped (engine/startup.py): a
    buffer that held the probe's session state kept that whole pool allocated (5.8 GiB on the H200)."""
    import gc
    import weakref

    fast, _ = _pipelines(sink_frames=3, window_frames=3)
    manager, kv, progress = _session(fast, "probe", 1, "a probe")
    for _ in range(2):  # the second block loads a history into the buffer
        fast.run_block(kv, progress)
    assert fast.context_kv["cond"].loads >= 1
    pool = weakref.ref(kv.pool)
    kv.close()
    del manager, kv, progress
    gc.collect()
    assert pool() is None
    # A new session's first load is a load, not a stale hit on the dead session's entry.
    manager, kv, progress = _session(fast, "next", 1, "a probe")
    fast.run_block(kv, progress)
    loads = fast.context_kv["cond"].loads
    fast.run_block(kv, progress)
    assert fast.context_kv["cond"].loads == loads + 1
