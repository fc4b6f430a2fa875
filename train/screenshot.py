"""Screenshot of the demo page streaming an example prompt on the default (trained tiny) model.

    python -m train.screenshot docs/img/tiny_demo.png

Starts ``arstream serve`` on a free 127.0.0.1 port, drives Debian's chromium
with Playwright (click an example prompt, Start, wait), saves a PNG, stops
the server. Bounded: every wait has a timeout.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from playwright.sync_api import sync_playwright

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--autoplay-policy=no-user-gesture-required"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    out = Path((argv or sys.argv[1:])[0])
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2)
                break
            except Exception:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the server did not become ready")
                time.sleep(0.5)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page(viewport={"width": 1100, "height": 720})
            page.goto(f"http://127.0.0.1:{port}/", wait_until="load")
            page.click("#examples button >> nth=0")
            page.fill("#seed", "0")
            page.click("#start")
            page.wait_for_function("Number(document.getElementById('chunks').textContent) >= 6", timeout=60000)
            time.sleep(1.0)
            page.screenshot(path=str(out))
            browser.close()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
