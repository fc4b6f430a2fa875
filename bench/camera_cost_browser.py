"""What the demo's camera costs the machine it runs on: the demo page over WebRTC in headless Chromium, the
camera (Chromium's fake device, 640x480 at 30 fps) on as live input, the browser and the server on the same cores.

Two runs, each on a fresh `arstream serve` (the server arguments after `--`) and a fresh browser: the page as it
ships (its camera capped to what the session takes: the session's frame rate and a size that still covers its
frame) and the reference, the camera sent as captured (`window.arstreamDemo.cameraLimits = false`). Over
`--seconds` of camera, after `--settle` seconds: CPU seconds per second of the server process and of every
Chromium process, what the page's sender encoded (size, frames per second, encode ms per frame), the live
frames the session received, used and dropped, its deadline misses, and the frames the page showed per second.
Prints ONE JSON line (and writes it to `--out`).

    python bench/camera_cost_browser.py -- --preset tiny
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_service_gpu import on_fresh_server, process_cpu_seconds, write  # noqa: E402

from tests.browser import CHROMIUM, CHROMIUM_ARGS  # noqa: E402

CAMERA_ARGS = ["--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream"]

SENDER_STATS = """async () => {
  const pc = window.arstreamDemo.peer;
  let out = null;
  (await pc.getStats()).forEach((r) => {
    if (r.type !== "outbound-rtp" || r.kind !== "video") return;
    out = { width: r.frameWidth || null, height: r.frameHeight || null, frames_encoded: r.framesEncoded || 0,
            encode_s: r.totalEncodeTime || 0, bytes_sent: r.bytesSent || 0 };
  });
  return out;
}"""


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (those gone meanwhile count nothing)."""
    return sum(process_cpu_seconds(pid) or 0.0 for pid in pids)


def chromium_pids() -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if command.endswith(b"chromium") or b"/chromium/" in command or command.endswith(b"chrome"):
                found.append(int(entry.name))
    return found


def session_detail(url: str, session_id: str) -> dict:
    import httpx

    return httpx.get(f"{url}/v1/sessions/{session_id}", timeout=10).json()


def measure(url: str, server_pid: int, limits: bool, args) -> dict:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS + CAMERA_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        try:
            page.goto(f"{url}/", wait_until="load")
            page.evaluate(f"() => {{ window.arstreamDemo.cameraLimits = {'true' if limits else 'false'}; }}")
            page.fill("#prompt", "a red circle drifting on a blue background")
            page.fill("#seed", str(args.seed))
            page.select_option("#transport", "webrtc")
            page.click("#start")
            page.wait_for_function("() => Number(document.getElementById('chunks').textContent) >= 2",
                                   timeout=120_000)
            page.evaluate("""() => { const v = document.querySelector('video'); window.presented = 0;
                const on = () => { window.presented += 1; v.requestVideoFrameCallback(on); };
                v.requestVideoFrameCallback(on); }""")
            session_id = page.evaluate("() => window.arstreamDemo.sessionId")
            page.click("#camera")
            page.wait_for_timeout(args.settle * 1000)
            browsers = chromium_pids()
            server_0, browser_0, at_0 = cpu_seconds([server_pid]), cpu_seconds(browsers), time.monotonic()
            sent_0, shown_0 = page.evaluate(SENDER_STATS), page.evaluate("() => window.presented")
            detail_0 = session_detail(url, session_id)
            page.wait_for_timeout(args.seconds * 1000)
            server_1, browser_1, at_1 = cpu_seconds([server_pid]), cpu_seconds(browsers), time.monotonic()
            sent_1, shown_1 = page.evaluate(SENDER_STATS), page.evaluate("() => window.presented")
            detail_1 = session_detail(url, session_id)
            errors = page.inner_text("#errors")
        finally:
            page.close()
            browser.close()
    span = at_1 - at_0
    encoded = sent_1["frames_encoded"] - sent_0["frames_encoded"]
    taken = {key: detail_1["input"][key] - detail_0["input"][key]
             for key in ("frames_received", "frames_used", "frames_dropped")}
    return {
        "camera_limits": limits, "seconds": round(span, 1),
        "server_cpu_per_s": round((server_1 - server_0) / span, 3),
        "browser_cpu_per_s": round((browser_1 - browser_0) / span, 3),
        "sent": {"width": sent_1["width"], "height": sent_1["height"], "fps": round(encoded / span, 1),
                 "encode_ms": round(1000 * (sent_1["encode_s"] - sent_0["encode_s"]) / encoded, 2) if encoded else None,
                 "kbit_per_s": round(8 * (sent_1["bytes_sent"] - sent_0["bytes_sent"]) / span / 1000, 1)},
        "session_input_per_s": {key: round(value / span, 1) for key, value in taken.items()},
        "deadline_misses": detail_1["realtime"]["deadline_misses"] - detail_0["realtime"]["deadline_misses"],
        "shown_per_s": round((shown_1 - shown_0) / span, 2),
        "errors": errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--settle", type=float, default=5.0, help="seconds of camera before measuring")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--order", default="limited,reference", help="which runs, in order")
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("server_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    server_args = [a for a in args.server_args if a != "--"]
    result = {"bench": "camera_cost_browser", "date": time.strftime("%Y-%m-%d"), "server_args": server_args,
              "cpu_count": os.cpu_count(), "runs": []}
    for name in args.order.split(","):
        result["runs"].append({"run": name, **on_fresh_server(
            server_args, args.ready_timeout,
            lambda server: measure(server.url, server.process.pid, name == "limited", args))})
    print(json.dumps(result))
    write(result, Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
