"""Control to screen in a real browser: the demo page in headless Chromium, over the WebSocket and over WebRTC.

For each transport a fresh `arstream serve` (the server arguments after `--`; its first session after `/readyz` is
the one measured) and a fresh page: Start with a red object, then every `--interval` seconds a `soft` prompt change
of the object's colour (red <-> yellow) clicked on the page. Two figures per change:

- **pixels**: the click -> the first frame Chromium presents (requestVideoFrameCallback, `expectedDisplayTime`)
  whose pixels show the new colour (a canvas read of the shown frame: what a viewer sees);
- **page**: what the page's own "to screen" readout timed (the click -> the first frame shown of the chunk that
  names the change, `chunk.controls`), split in two: **named** (the click -> that chunk's message arrives: the
  server's part) and **player** (that message -> its first frame shown: the release margin, the transport's
  pacing, the browser's buffer, decode and paint);
- **server**: the session's own control latency (`GET /v1/sessions/{id}`: arrival -> the first frame on the
  viewer's clock, as the engine planned it).

Also the page's first-chunk time, and frames shown per second. Prints ONE JSON line (and writes it to `--out`).

    python bench/control_to_screen_browser.py --changes 12 -- --preset tiny
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_service_gpu import on_fresh_server, write  # noqa: E402
from control_to_screen import _stats  # noqa: E402

from tests.browser import CHROMIUM, CHROMIUM_ARGS, COLOUR_READER  # noqa: E402

COLOURS = ("red", "yellow")
MIN_PIXELS = 20  # an object's colour counts as shown with this many pixels of it, more than of the other


# The peer's receive side (WebRTC only): per kind, the jitter buffer's mean delay and target and the decode time
# per frame (ms) -- where the player's share of the latency goes.
RECEIVE_STATS = """async () => {
  const pc = window.arstreamDemo.peer;
  if (!pc) return null;
  const out = {};
  (await pc.getStats()).forEach((r) => {
    if (r.type !== "inbound-rtp") return;
    const n = r.jitterBufferEmittedCount || 0;
    const per = (x) => (n && typeof x === "number" ? Math.round(1000 * x / n * 10) / 10 : null);
    out[r.kind] = { jitter_buffer_ms: per(r.jitterBufferDelay), target_ms: per(r.jitterBufferTargetDelay),
                    minimum_ms: per(r.jitterBufferMinimumDelay),
                    decode_ms: r.framesDecoded ? Math.round(1000 * r.totalDecodeTime / r.framesDecoded * 10) / 10 : null,
                    processing_ms: per(r.totalProcessingDelay), jitter_ms: r.jitter ? Math.round(1000 * r.jitter) : null };
  });
  return out;
}"""


def caption(colour: str) -> str:
    return f"a {colour} circle drifting on a blue background"


def measure(url: str, transport: str, args) -> dict:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        try:
            page.goto(f"{url}/", wait_until="load")
            page.fill("#prompt", caption(COLOURS[0]))
            page.fill("#seed", str(args.seed))
            page.select_option("#transport", transport)
            page.click("#start")
            page.wait_for_function("() => Number(document.getElementById('chunks').textContent) >= 2",
                                   timeout=120_000)
            in_use = page.inner_text("#transport-in-use")
            page.evaluate(COLOUR_READER)
            # A stall as the viewer meets it: the video element waits for data (MSE), or a frame is shown more
            # than twice a frame's time after the one before (either transport).
            page.evaluate("() => { window.waits = 0; window.rates = []; const v = document.querySelector('video');"
                          "v.addEventListener('waiting', () => { window.waits += 1; });"
                          "v.addEventListener('ratechange', () => { window.rates.push([performance.now(), v.playbackRate]); }); }")
            page.wait_for_timeout(args.first_change * 1000)
            changes = []
            colour = COLOURS[0]
            # A change lands anywhere in a block (0.75 s): seeded waits of the interval plus up to one block, the
            # same for every transport, so no run is timed at one phase of the block only.
            phases = random.Random(args.seed)
            for index in range(args.changes):
                colour = COLOURS[(COLOURS.index(colour) + 1) % 2]
                page.fill("#prompt", caption(colour))
                page.select_option("#policy", "soft")
                clicked = page.evaluate("() => { const t = performance.now(); "
                                        "document.getElementById('apply').click(); return t; }")
                changes.append((clicked, colour))
                page.wait_for_timeout((args.interval + phases.uniform(0, 0.75)) * 1000)
            shown = page.evaluate("() => window.shown")
            timed = page.evaluate("() => window.arstreamDemo.toScreen")
            waits = page.evaluate("() => window.waits")
            rates = page.evaluate("() => window.rates")
            server_readout = page.inner_text("#server")
            first_chunk = page.inner_text("#ttfc")
            session_id = page.evaluate("() => window.arstreamDemo.sessionId")
            receive_stats = page.evaluate(RECEIVE_STATS)
            server_latency = _server_control_latency(url, session_id)
            errors = page.inner_text("#errors")
        finally:
            page.close()
            browser.close()
    pixels, page_ms = [], [t["ms"] / 1000 for t in timed]
    named = [t["namedMs"] / 1000 for t in timed if "namedMs" in t]
    player = [(t["ms"] - t["namedMs"]) / 1000 for t in timed if "namedMs" in t]
    for clicked, colour in changes:
        other = "red" if colour == "yellow" else "yellow"
        first = next((f for f in shown if f["at"] > clicked and f[colour] > MIN_PIXELS and f[colour] > f[other]),
                     None)
        if first is not None and first["at"] - clicked < args.interval * 1000:
            pixels.append((first["at"] - clicked) / 1000)
    span_s = (shown[-1]["at"] - shown[0]["at"]) / 1000 if len(shown) > 1 else 0
    late = [b["at"] - a["at"] for a, b in zip(shown, shown[1:]) if b["at"] - a["at"] > 2 * 1000 / 16]
    late_at = [round((a["at"] - shown[0]["at"]) / 1000, 1) for a, b in zip(shown, shown[1:])
               if b["at"] - a["at"] > 2 * 1000 / 16]  # seconds into what was watched
    return {"transport": transport, "in_use": in_use, "first_chunk": first_chunk, "errors": errors,
            "server_readout": server_readout,
            "frames_shown_per_s": round((len(shown) - 1) / span_s, 2) if span_s else None,
            "waiting_events": waits, "frame_gaps_over_2_frames": len(late),
            "frame_gap_s": round(sum(late) / 1000, 3), "frame_gaps_at_s": late_at, "seconds_watched": round(span_s, 1),
            "rate_changes_at_s": [[round((at - shown[0]["at"]) / 1000, 1), rate] for at, rate in rates] if shown else [],
            "pixels": _stats(pixels) | {"read": f"{len(pixels)} of {len(changes)}"},
            "page": _stats(page_ms), "named": _stats(named), "player": _stats(player),
            "server": server_latency, "receiver": receive_stats}


def _server_control_latency(url: str, session_id: str | None) -> dict | None:
    """The session's recent control latencies as the engine stamped them (count, median, p90, max: seconds)."""
    if not session_id:
        return None
    import httpx

    response = httpx.get(f"{url}/v1/sessions/{session_id}", timeout=10)
    return response.json().get("control_latency") if response.status_code == 200 else None


def on_fresh_server_per_transport(server_args: list[str], args, measure, log_name: str) -> list[dict]:
    """``measure(url, transport, args)`` once per transport of ``args.transports`` (comma-separated), each on a
    fresh `arstream serve` (its log kept as ``{log_name}-{transport}.log`` under ``args.log_dir``, if given)."""
    runs = []
    for transport in args.transports.split(","):
        log_path = Path(args.log_dir) / f"{log_name}-{transport}.log" if args.log_dir else None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
        runs.append(on_fresh_server(server_args, args.ready_timeout,
                                    lambda server: measure(server.url, transport, args), log_path))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=12)
    parser.add_argument("--interval", type=float, default=3.0, help="seconds between changes (plus 0-0.75 s)")
    parser.add_argument("--first-change", type=float, default=3.0, help="seconds of playback before the first")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--transports", default="websocket,webrtc")
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    parser.add_argument("--log-dir", default=None, help="keep each server's log here")
    parser.add_argument("--out", default=None)
    parser.add_argument("server_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    server_args = [a for a in args.server_args if a != "--"]
    result = {"bench": "control_to_screen_browser", "date": time.strftime("%Y-%m-%d"), "server_args": server_args,
              "chromium": CHROMIUM, "runs": []}
    result["runs"] = on_fresh_server_per_transport(server_args, args, measure, "browser")
    print(json.dumps(result))
    write(result, Path(args.out) if args.out else None)
    for run in result["runs"]:
        print(f"{run['transport']:10s} pixels median {run['pixels'].get('median_s')} p90 {run['pixels'].get('p90_s')} "
              f"({run['pixels']['read']}) page median {run['page'].get('median_s')} "
              f"named {run['named'].get('median_s')} player {run['player'].get('median_s')} "
              f"server {(run['server'] or {}).get('median_s')} receiver {run['receiver']} first chunk {run['first_chunk']} gaps {run['frame_gaps_over_2_frames']} waiting {run['waiting_events']}",
              file=sys.stderr)


if __name__ == "__main__":
    main()
