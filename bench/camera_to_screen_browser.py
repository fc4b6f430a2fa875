"""Camera to screen in a real browser, read from the pixels, over the WebSocket and over WebRTC.

The demo page in headless Chromium, its camera a file Chromium plays as a fake device (`--use-file-for-fake-
video-capture`): dark grey with a white square whose place moves with the frame count (114 places, 7 s at 16
fps). The session starts from a prompt, then the page's Camera button puts the camera on as live input at
`--strength` (0: the output is the camera's round trip through the codec, so the square can be read in it). Both
the camera's preview on the page (`#input-video`) and the output (`#video`) are read frame by frame as they are
presented (requestVideoFrameCallback + a canvas read of the square's place); a camera frame's time is when the
preview showed it, and camera to screen is, for each output frame showing a square, the time from the newest
preview frame with the square in that place to the output frame's presentation: what a user in front of the
camera would see, minus the camera's own capture delay, on either transport (the page's own "camera to screen"
readout, from `chunk.input_frame`, exists over the socket only and is reported beside it).

Each transport runs on a fresh `arstream serve` (its first session after `/readyz`) and a fresh browser. Prints ONE
JSON line (and writes it to `--out`).

    python bench/camera_to_screen_browser.py --seconds 30 -- --preset tiny
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_service_gpu import write  # noqa: E402
from control_to_screen import _stats  # noqa: E402
from control_to_screen_browser import on_fresh_server_per_transport  # noqa: E402

from tests.browser import CHROMIUM, CHROMIUM_ARGS  # noqa: E402

WIDTH, HEIGHT, FPS = 256, 144, 16
SQUARE = 24
COLUMNS = (WIDTH - SQUARE) // 6  # 38 places across, 6 px apart
ROWS = 3                          # ... on three rows: 114 frames before a place comes again
PLACE_TOLERANCE = 1.5             # steps (6 px): a square read further than this from every place is none


def place(index: int) -> tuple[int, int]:
    """The square's top-left corner in camera frame ``index``."""
    step = index % (COLUMNS * ROWS)
    return 6 * (step % COLUMNS), HEIGHT // 4 * (1 + step // COLUMNS) - SQUARE // 2


def write_camera(path: Path, frames: int = COLUMNS * ROWS) -> None:
    """The fake camera: ``frames`` frames of the moving square as a Y4M file (4:2:0), which Chromium loops."""
    with path.open("wb") as out:
        out.write(f"YUV4MPEG2 W{WIDTH} H{HEIGHT} F{FPS}:1 Ip A1:1 C420jpeg\n".encode())
        chroma = np.full(WIDTH * HEIGHT // 2, 128, np.uint8).tobytes()
        for index in range(frames):
            luma = np.full((HEIGHT, WIDTH), 40, np.uint8)
            x, y = place(index)
            luma[y:y + SQUARE, x:x + SQUARE] = 235
            out.write(b"FRAME\n" + luma.tobytes() + chroma)


# Reads every frame both video elements present: the white square's centre as a fraction of the frame (null when
# there is none), with the presentation time. window.squares = {input: [...], output: [...]}.
SQUARE_READER = """() => {
  const canvas = document.createElement("canvas");
  canvas.width = 128; canvas.height = 72;
  const ctx = canvas.getContext("2d", { willReadFrequently: true });
  window.squares = { input: [], output: [] };
  const read = (video, into) => {
    const onFrame = (now, meta) => {
      ctx.drawImage(video, 0, 0, 128, 72);
      const px = ctx.getImageData(0, 0, 128, 72).data;
      let n = 0, sx = 0, sy = 0;
      for (let i = 0; i < px.length; i += 4) {
        if (px[i] + px[i + 1] + px[i + 2] > 3 * 170) { const p = i / 4; n += 1; sx += p % 128; sy += Math.floor(p / 128); }
      }
      into.push({ at: meta.expectedDisplayTime || now, n, x: n ? (sx / n + 0.5) / 128 : null, y: n ? (sy / n + 0.5) / 72 : null });
      if (into.length > 20000) into.shift();
      video.requestVideoFrameCallback(onFrame);
    };
    video.requestVideoFrameCallback(onFrame);
  };
  read(document.querySelector("#input-video"), window.squares.input);
  read(document.querySelector("#video"), window.squares.output);
}"""


def read_place(x: float | None, y: float | None) -> int | None:
    """The place (0..113) of a square centred at (x, y) (fractions of the frame), None if it is at none."""
    if x is None:
        return None
    best, best_d = None, None
    for step in range(COLUMNS * ROWS):
        px, py = place(step)
        d = max(abs(x * WIDTH - (px + SQUARE / 2)) / 6, abs(y * HEIGHT - (py + SQUARE / 2)) / 6)
        if best_d is None or d < best_d:
            best, best_d = step, d
    return best if best_d <= PLACE_TOLERANCE else None


def latencies(inputs: list[dict], outputs: list[dict]) -> tuple[list[float], int]:
    """Per output frame showing a square: its presentation less the newest preview frame at that place before it.
    Also how many output frames showed a square no preview frame had shown before (not counted)."""
    min_pixels = SQUARE * SQUARE // 16 // 3  # a third of the square, read at half size
    seen: dict[int, list[float]] = {}
    for frame in inputs:
        if frame["n"] >= min_pixels:
            step = read_place(frame["x"], frame["y"])
            if step is not None:
                seen.setdefault(step, []).append(frame["at"])
    out, unmatched = [], 0
    for frame in outputs:
        if frame["n"] < min_pixels:
            continue
        step = read_place(frame["x"], frame["y"])
        earlier = [at for at in seen.get(step, []) if at <= frame["at"]] if step is not None else []
        if not earlier:
            unmatched += 1
            continue
        out.append((frame["at"] - earlier[-1]) / 1000)
    return out, unmatched


def measure(url: str, transport: str, args) -> dict:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS + [
            "--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream",
            f"--use-file-for-fake-video-capture={args.camera_file}"])
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        try:
            page.goto(f"{url}/", wait_until="load")
            page.fill("#prompt", "a red circle drifting on a blue background")
            page.select_option("#transport", transport)
            page.fill("#strength", str(args.strength))
            page.dispatch_event("#strength", "change")
            page.click("#start")
            page.wait_for_function("() => Number(document.getElementById('chunks').textContent) >= 2",
                                   timeout=120_000)
            in_use = page.inner_text("#transport-in-use")
            page.evaluate("() => { window.waits = 0; document.querySelector('#video')"
                          ".addEventListener('waiting', () => { window.waits += 1; }); }")
            page.click("#camera")
            page.wait_for_function("() => !document.querySelector('#input-video').hidden", timeout=30_000)
            page.evaluate(SQUARE_READER)
            page.wait_for_timeout(args.settle * 1000)
            page.evaluate("() => { window.squares.input.length = 0; window.squares.output.length = 0; "
                          "window.waits = 0; window.arstreamDemo.cameraToScreen.length = 0; }")
            page.wait_for_timeout(args.seconds * 1000)
            squares = page.evaluate("() => window.squares")
            waits = page.evaluate("() => window.waits")
            named = page.evaluate("() => window.arstreamDemo.cameraToScreen")
            session_id = page.evaluate("() => window.arstreamDemo.sessionId")
            errors = page.inner_text("#errors")
        finally:
            page.close()
            browser.close()
    import httpx

    status = httpx.get(f"{url}/v1/sessions/{session_id}", timeout=10).json() if session_id else {}
    values, unmatched = latencies(squares["input"], squares["output"])
    shown = [f["at"] for f in squares["output"]]
    gaps = [b - a for a, b in zip(shown, shown[1:]) if b - a > 2 * 1000 / FPS]
    span_s = (shown[-1] - shown[0]) / 1000 if len(shown) > 1 else 0
    return {"transport": transport, "in_use": in_use, "strength": args.strength, "errors": errors,
            "camera_to_screen": _stats(values) | {"frames_read": len(values), "unmatched": unmatched},
            "page_readout": _stats([t["ms"] / 1000 for t in named]),
            "preview_frames": len(squares["input"]), "output_frames": len(shown),
            "frames_shown_per_s": round((len(shown) - 1) / span_s, 2) if span_s else None,
            "waiting_events": waits, "frame_gaps_over_2_frames": len(gaps), "seconds_watched": round(span_s, 1),
            "server_input": status.get("input")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds of camera measured")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds of camera before measuring")
    parser.add_argument("--strength", type=float, default=0.0)
    parser.add_argument("--transports", default="websocket,webrtc")
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    parser.add_argument("--log-dir", default=None, help="keep each server's log here")
    parser.add_argument("--out", default=None)
    parser.add_argument("server_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    server_args = [a for a in args.server_args if a != "--"]
    result = {"bench": "camera_to_screen_browser", "date": time.strftime("%Y-%m-%d"), "server_args": server_args,
              "chromium": CHROMIUM, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        args.camera_file = Path(tmp) / "camera.y4m"
        write_camera(args.camera_file)
        result["runs"] = on_fresh_server_per_transport(server_args, args, measure, "camera")
    print(json.dumps(result))
    write(result, Path(args.out) if args.out else None)
    for run in result["runs"]:
        c = run["camera_to_screen"]
        print(f"{run['transport']:10s} camera to screen median {c.get('median_s')} p90 {c.get('p90_s')} "
              f"({c['frames_read']} frames, {c['unmatched']} unmatched) page readout {run['page_readout'].get('median_s')} "
              f"gaps {run['frame_gaps_over_2_frames']} waiting {run['waiting_events']} errors {run['errors']}",
              file=sys.stderr)


if __name__ == "__main__":
    main()
