"""Where the Wan VAE's streaming decode spends a block: time, work and achieved TFLOP/s per decoder stage.

Prints ONE JSON line. One session's streaming decode as the engine runs it (``WanStreamingDecoder``, one
latent frame per call on the causal cache): an opening chunk, warm-up blocks, then timed steady blocks of
``--latent-frames`` latent frames. Each stage of ``vae.decoder`` (conv_in, mid_block, up_blocks.N, norm_out,
conv_out) is timed with hooks (CUDA events on a GPU, a synchronised clock on the CPU) and its FLOPs are counted
with torch's FlopCounterMode over one steady block. The whole block is also timed without hooks (the reference
the stage times must add up to), and with ``--compile`` through the engine's compiled steady state too.

    python bench/vae_decode_stages.py --device cuda --dtype bfloat16                 # 832x480, issue 23
    python bench/vae_decode_stages.py --height 96 --width 160 --blocks 1 --warmup 1   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from collections import defaultdict

import torch
from diffusers import AutoencoderKLWan
from torch.utils.flop_counter import FlopCounterMode

from decoders.video import WanStreamingDecoder
from engine.models.presets import WAN_2_1_VAE_CONFIG


def stages(decoder: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The decoder's top-level stages in run order, by their module names (the head: norm_out, conv_out)."""
    named = {"conv_in": decoder.conv_in, "mid_block": decoder.mid_block}
    for index, block in enumerate(decoder.up_blocks):
        named[f"up_blocks.{index}"] = block
    named["norm_out"] = decoder.norm_out
    named["conv_out"] = decoder.conv_out
    return named


class StageTimer:
    """Forward pre/post hooks that time each stage; on CUDA with events read once per block."""

    def __init__(self, named: dict[str, torch.nn.Module], device: torch.device) -> None:
        self.device = device
        self.pending: list[tuple[str, object, object]] = []
        self.ms: dict[str, list[float]] = defaultdict(list)
        self.handles = []
        for name, module in named.items():
            self.handles.append(module.register_forward_pre_hook(self._start(name)))
            self.handles.append(module.register_forward_hook(self._stop(name)))
        self._open: dict[str, object] = {}

    def _now(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _start(self, name):
        def hook(module, args):
            self._open[name] = self._now()
        return hook

    def _stop(self, name):
        def hook(module, args, output):
            self.pending.append((name, self._open.pop(name), self._now()))
        return hook

    def collect(self) -> dict[str, float]:
        """Per-stage milliseconds of what ran since the last call, summed over the block's frames."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        block: dict[str, float] = defaultdict(float)
        for name, start, stop in self.pending:
            block[name] += start.elapsed_time(stop) if self.device.type == "cuda" else (stop - start) * 1000
        self.pending.clear()
        for name, value in block.items():
            self.ms[name].append(value)
        return block

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def stage_flops(decoder: WanStreamingDecoder, named: dict[str, torch.nn.Module], latents, state) -> dict[str, int]:
    """FLOPs per stage over one block's decode (FlopCounterMode's per-module counts, by stage prefix)."""
    with FlopCounterMode(display=False) as counter:
        decoder.decode_chunk(latents, state)
    counts = counter.get_flop_counts()
    out = {}
    for name in named:
        total = 0
        for module_name, ops in counts.items():
            parts = module_name.split(".")
            # FlopCounterMode names modules from the outermost one it saw (e.g. "WanDecoder3d.up_blocks.0").
            if ".".join(parts[1:]) == name:
                total = sum(ops.values())
        out[name] = total
    out["whole"] = sum(counts.get("Global", {}).values())
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_blocks(decoder: WanStreamingDecoder, state, chunks, device: torch.device) -> tuple[list[float], torch.Tensor]:
    """Milliseconds of each steady block decode of ``chunks`` (the device synchronised around each), and the
    last block's output."""
    times, last = [], None
    for chunk in chunks:
        started = time.perf_counter()
        last = decoder.decode_chunk(chunk, state)
        sync(device)
        times.append((time.perf_counter() - started) * 1000)
    return times, last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--latent-frames", type=int, default=3, help="latent frames a block (3: 12 video frames)")
    parser.add_argument("--warmup", type=int, default=3, help="steady blocks before timing (cuDNN's choices)")
    parser.add_argument("--blocks", type=int, default=5, help="timed steady blocks")
    parser.add_argument("--compile", action="store_true", help="also time the engine's compiled steady state")
    parser.add_argument("--fast-path", action="store_true",
                        help="profile the conv2d path (decoders.video.causal_conv3d_as_conv2d, channels-last) instead")
    parser.add_argument("--variants", action="store_true",
                        help="also time whole blocks of each path: conv3d / conv2d, eager / compiled, conv3d on "
                        "channels-last-3d weights and latents, against conv3d eager")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**WAN_2_1_VAE_CONFIG).to(device, dtype).eval()
    decoder = WanStreamingDecoder(vae, fast_path=args.fast_path)  # the device's default: diffusers' causal conv3d
    h, w = args.height // 8, args.width // 8
    latents = lambda: torch.randn(1, vae.config.z_dim, args.latent_frames, h, w, device=device, dtype=dtype)  # noqa: E731

    state = decoder.new_state("bench")
    decoder.decode_chunk(latents(), state)  # the opening chunk
    for _ in range(args.warmup):
        decoder.decode_chunk(latents(), state)
    sync(device)

    whole, _ = time_blocks(decoder, state, (latents() for _ in range(args.blocks)), device)  # without hooks

    named = stages(vae.decoder)
    timer = StageTimer(named, device)
    for _ in range(args.blocks):
        decoder.decode_chunk(latents(), state)
        timer.collect()
    timer.remove()
    flops = stage_flops(decoder, named, latents(), state)

    table = {}
    for name in named:
        ms = statistics.median(timer.ms[name]) if timer.ms[name] else float("nan")
        table[name] = {"ms": round(ms, 2), "gflop": round(flops[name] / 1e9, 1),
                       "tflop_s": round(flops[name] / (ms / 1000) / 1e12, 1) if ms == ms and ms > 0 else None}
    whole_ms = statistics.median(whole)
    result = {
        "bench": "vae_decode_stages",
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "size": [args.width, args.height],
        "latent_frames_per_block": args.latent_frames,
        "video_frames_per_block": 4 * args.latent_frames,
        "block_ms_median": round(whole_ms, 2),
        "block_ms_all": [round(v, 2) for v in whole],
        "block_tflop": round(flops["whole"] / 1e12, 2),
        "block_tflop_s": round(flops["whole"] / (whole_ms / 1000) / 1e12, 1),
        "stages": table,
        "stages_ms_sum": round(sum(v["ms"] for v in table.values() if v["ms"] == v["ms"]), 2),
        "path": "conv2d" if args.fast_path else "conv3d",
    }
    if args.compile:
        compiled = WanStreamingDecoder(vae, fast_path=False, compile_steady_state=True)
        state = compiled.new_state("compiled")
        compiled.decode_chunk(latents(), state)
        for _ in range(args.warmup + 2):  # the steady state starts after a few frames, then compiles
            compiled.decode_chunk(latents(), state)
        sync(device)
        times, _ = time_blocks(compiled, state, (latents() for _ in range(args.blocks)), device)
        result["compiled_block_ms_median"] = round(statistics.median(times), 2)
    if args.variants:
        result["variants"] = variants(vae, latents, args.warmup, args.blocks, device)
    print(json.dumps(result))


# name: (conv2d path, compiled, channels-last-3d weights and latents)
VARIANTS = {"conv3d_eager": (False, False, False), "conv2d_eager": (True, False, False),
            "conv3d_compiled": (False, True, False), "conv2d_compiled": (True, True, False),
            "conv3d_eager_channels_last": (False, False, True), "conv3d_compiled_channels_last": (False, True, True)}


def channels_last_3d(module: torch.nn.Module) -> torch.nn.Module:
    """The module's 5-D weights (the 3-D convolutions') in channels-last-3d memory; the rest as they are."""
    with torch.no_grad():
        for parameter in module.parameters():
            if parameter.ndim == 5:
                parameter.data = parameter.data.contiguous(memory_format=torch.channels_last_3d)
    return module


def variants(vae, latents, warmup: int, blocks: int, device: torch.device) -> dict:
    """Each path's steady block on the same latents from a fresh session, and its output's largest difference
    from conv3d eager's (the reference: diffusers' own decoder) on the last block."""
    torch.manual_seed(1)
    inputs = [latents() for _ in range(1 + warmup + 2 + blocks)]
    out, reference = {}, None
    for name, (fast, compiled, channels_last) in VARIANTS.items():
        layout = torch.channels_last_3d if channels_last else torch.contiguous_format
        model = channels_last_3d(copy.deepcopy(vae)) if channels_last else vae
        decoder = WanStreamingDecoder(model, fast_path=fast, compile_steady_state=compiled)
        state = decoder.new_state(name)
        try:
            for chunk in inputs[: 1 + warmup + 2]:  # the opening chunk, warm-up (and the compile)
                decoder.decode_chunk(chunk.contiguous(memory_format=layout), state)
            sync(device)
            steady = [chunk.contiguous(memory_format=layout) for chunk in inputs[1 + warmup + 2 :]]
            times, last = time_blocks(decoder, state, steady, device)
        except Exception as error:  # noqa: BLE001 - a path that fails is a finding, not the end of the run
            out[name] = {"error": f"{type(error).__name__}: {error}"[:300]}
            continue
        entry = {"block_ms_median": round(statistics.median(times), 2), "block_ms_min": round(min(times), 2)}
        if reference is None:
            reference = last.float()
        else:
            entry["max_abs_diff_vs_conv3d_eager"] = round((last.float() - reference).abs().max().item(), 5)
        if compiled:
            entry["compiled_calls"] = decoder.steady_state.calls
            entry["compile_failed"] = decoder.steady_state.failed
        out[name] = entry
        del state, decoder, model
    return out


if __name__ == "__main__":
    main()
