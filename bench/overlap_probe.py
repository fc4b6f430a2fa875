"""Would the decode of block N overlapped with the denoise of block N+1 pay? (issue 31, before building it)

Prints ONE JSON line. One session of the configured model, as the engine runs it (the pipeline's block, the
streaming decoder one latent frame per call), timed three ways after a warm-up that fills the window:

* ``serial``: denoise + commit of a block, then its decode, on one stream (what the engine does today; the
  reference path);
* ``overlapped``: the decode of block N on a second stream while block N+1 is denoised on the first (each block
  still waits for its own latents: an event, not a host sync), all launched from one host thread;
* ``overlapped_threaded``: the same with the decode launched from a second host thread;
* ``denoise_only`` / ``decode_only``: each alone, the floor the overlap is judged against
  (``max(denoise, decode)`` if the two shared the GPU perfectly, ``denoise + decode`` if not at all).

The overlapped stream's frames are compared with the serial stream's (same seed, same weights: equal up to
the order the GPU ran things in, which does not change any kernel's inputs).

    python bench/overlap_probe.py --device cuda --dtype bfloat16 --preset wan2.1-1.3b            # standard
    python bench/overlap_probe.py --device cuda --dtype bfloat16 --preset wan2.1-1.3b --fp8 attention
    python bench/overlap_probe.py --blocks 3 --warmup 2                                             # CPU smoke
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import platform
import time

import torch

from engine.bundle import build_models
from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager


class Session:
    """One session's KV, progress and decoder state."""

    def __init__(self, bundle, device: str, name: str) -> None:
        self.bundle = bundle
        self.manager = KVCacheManager(bundle.pipeline.kv_spec(), 1, device)
        self.kv = self.manager.open_session(name)
        self.progress = bundle.pipeline.new_progress(seed=0, prompt="a red circle bouncing on a blue background")
        self.state = bundle.decoder.new_state(name)

    def denoise(self) -> torch.Tensor:
        clean = self.bundle.pipeline.run_block(self.kv, self.progress)
        return self.bundle.decoder.denormalize(clean.video)

    def decode(self, video: torch.Tensor) -> torch.Tensor:
        decoder = self.bundle.decoder
        frames = [decoder.to_uint8_tensor(decoder.decode_chunk(video[:, :, i:i + 1], self.state))
                  for i in range(video.shape[2])]
        return torch.cat(frames, dim=0) if frames[0].ndim == 4 else torch.cat(frames, dim=1)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(device, fn, blocks: int) -> float:
    sync(device)
    start = time.perf_counter()
    fn(blocks)
    sync(device)
    return (time.perf_counter() - start) * 1000 / blocks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--fp8", default=None)
    parser.add_argument("--window-frames", type=int, default=None)
    parser.add_argument("--video-decoder", default=None)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=8)
    args = parser.parse_args()
    settings = dict(preset=args.preset, device=args.device, dtype=args.dtype, random_weights=True)
    for key in ("fp8", "window_frames", "video_decoder"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    config = EngineConfig(**settings)
    bundle = build_models(config)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    side = torch.cuda.Stream() if cuda else None

    serial_session, overlap_session = Session(bundle, args.device, "serial"), Session(bundle, args.device, "overlap")
    serial_frames: list[torch.Tensor] = []
    overlap_frames: list[torch.Tensor] = []

    def serial(blocks: int) -> None:
        for _ in range(blocks):
            serial_frames.append(serial_session.decode(serial_session.denoise()))

    threaded_frames: list[torch.Tensor] = []
    threaded_session = Session(bundle, args.device, "threaded")

    def decode_beside(session: Session, video: torch.Tensor, ready) -> tuple[torch.Tensor, object]:
        """Block N's decode on the side stream once its latents are ready; its frames and the event they are
        done at (None off CUDA)."""
        if not cuda:
            return session.decode(video), None
        with torch.cuda.stream(side):
            side.wait_event(ready)
            frames = session.decode(video)
            done = torch.cuda.Event()
            done.record()
        video.record_stream(side)
        return frames, done

    def overlapped(blocks: int, session: Session, out: list[torch.Tensor], pool=None) -> None:
        """Each block's decode beside the next block's denoise. ``pool``: the decode launched from its host thread
        (launches from one thread serialise the two: the decode's many small kernels hold the host while the
        denoise waits to be queued); without one, from this thread, and the main stream waits for the side
        stream once, at the end."""
        pending = None  # (latents, their ready event) of the block whose decode runs beside the next denoise
        for index in range(blocks + 1):
            job = None
            if pending is not None:
                job = (pool.submit(decode_beside, session, *pending) if pool is not None
                       else decode_beside(session, *pending))
            if index < blocks:
                video = session.denoise()
                ready = None
                if cuda:
                    ready = torch.cuda.Event()
                    ready.record()
                pending = (video, ready)
            if job is not None:
                frames, done = job.result() if pool is not None else job
                if pool is not None and done is not None:
                    torch.cuda.current_stream().wait_event(done)
                out.append(frames)
        if cuda:
            torch.cuda.current_stream().wait_stream(side)

    def one_thread(blocks: int) -> None:
        overlapped(blocks, overlap_session, overlap_frames)

    def threaded(blocks: int) -> None:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            overlapped(blocks, threaded_session, threaded_frames, pool)

    def denoise_only(blocks: int) -> None:
        for _ in range(blocks):
            serial_session.denoise()

    latents_for_decode: list[torch.Tensor] = []

    def decode_only(blocks: int) -> None:
        for index in range(blocks):
            serial_session.decode(latents_for_decode[index % len(latents_for_decode)])

    # Warm-up: every kernel, compile and graph, the window filled (both sessions alike, so their frames match).
    serial(args.warmup)
    one_thread(args.warmup)
    threaded(args.warmup)
    for _ in range(2):
        latents_for_decode.append(serial_session.denoise())
    # Decode-only goes last on the serial session (it advances its decoder state); the others interleave.
    serial_ms = timed(device, serial, args.blocks)
    overlap_ms = timed(device, one_thread, args.blocks)
    threaded_ms = timed(device, threaded, args.blocks)
    serial_again_ms = timed(device, serial, args.blocks)
    denoise_ms = timed(device, denoise_only, args.blocks)
    decode_ms = timed(device, decode_only, args.blocks)
    compared = min(len(serial_frames), len(overlap_frames), args.warmup)
    worst = max(int((a.int() - b.int()).abs().max()) for a, b in zip(serial_frames[:compared], overlap_frames[:compared]))
    worst_threaded = max(int((a.int() - b.int()).abs().max())
                         for a, b in zip(serial_frames[:compared], threaded_frames[:compared]))
    last = serial_frames[-1]  # a steady block (the first one's frames are fewer)
    frames_per_block = last.shape[0] if last.ndim == 4 else last.shape[1]
    serial_best = min(serial_ms, serial_again_ms)
    result = {
        "bench": "overlap_probe",
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "settings": settings,
        "blocks": args.blocks,
        "frames_per_block": frames_per_block,
        "serial_ms_per_block": [round(serial_ms, 1), round(serial_again_ms, 1)],
        "overlapped_ms_per_block": round(overlap_ms, 1),
        "overlapped_threaded_ms_per_block": round(threaded_ms, 1),
        "denoise_only_ms": round(denoise_ms, 1),
        "decode_only_ms": round(decode_ms, 1),
        "perfect_overlap_ms": round(max(denoise_ms, decode_ms), 1),
        "frames_per_s": {"serial": round(1000 * frames_per_block / serial_best, 2),
                         "overlapped": round(1000 * frames_per_block / overlap_ms, 2),
                         "overlapped_threaded": round(1000 * frames_per_block / threaded_ms, 2)},
        "gain_vs_serial": round(1 - overlap_ms / serial_best, 3),
        "gain_vs_serial_threaded": round(1 - threaded_ms / serial_best, 3),
        "warmup_frames_max_abs_diff_serial_vs_overlapped": [worst, worst_threaded],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
