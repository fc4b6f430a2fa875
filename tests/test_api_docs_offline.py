"""`/docs` renders with no internet: headless Debian chromium against the real server, every request
to another host refused. Swagger UI's script and style come from the app (fastapi-offline's files)."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import sync_playwright

from tests.browser import CHROMIUM, CHROMIUM_ARGS


def test_docs_page_renders_the_operations_with_other_hosts_blocked(shared_server):
    server = shared_server
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (this test never skips)")
    own_host = urlsplit(server.base_url).netloc
    blocked: list[str] = []

    def only_this_server(route):
        if urlsplit(route.request.url).netloc == own_host:
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort("internetdisconnected")

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.route("**/*", only_this_server)
            page.goto(f"{server.base_url}/docs", wait_until="load")
            page.wait_for_selector(".opblock-summary-path", timeout=20_000)
            paths = page.eval_on_selector_all(
                ".opblock-summary-path", "nodes => nodes.map((n) => n.getAttribute('data-path') || n.textContent)"
            )
            title = page.inner_text(".information-container .title")
        finally:
            browser.close()
    paths = [path.replace("\u200b", "") for path in paths]  # Swagger UI breaks long paths with zero-width spaces
    assert "/v1/sessions" in paths and "/v1/sessions/{session_id}" in paths, paths
    assert "/readyz" in paths and "/healthz" in paths, paths
    assert "arstream" in title
    assert not blocked, f"/docs asked other hosts for: {blocked}"
