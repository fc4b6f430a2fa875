"""The session table is bounded: an ended session is forgotten after the retention period, whatever ended it.

Through a real `arstream serve`: sessions ended by a `close` message and by the engine (maximum duration)
while their socket was attached — the two ways that used to stay listed forever — and one deleted over
REST. Also: a session created over REST with a prompt reports that prompt's length before it starts.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import start_server
from tests.stream_client import StreamClient

RETENTION_S = 0.5
MAX_SESSION_S = 3.0


@pytest.fixture(scope="module")
def server():
    running = start_server(
        "--max-sessions", "4",
        env={"ARSTREAM_CLOSED_RETENTION_S": str(RETENTION_S), "ARSTREAM_ENGINE__MAX_SESSION_S": str(MAX_SESSION_S)},
    )
    try:
        yield running
    finally:
        running.stop()


def _request(server, method: str, path: str, body: dict | None = None) -> tuple[int, dict | None]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        server.base_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read()
            return response.status, json.loads(text) if text else None
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def _listed(server) -> set[str]:
    return {s["session_id"] for s in _request(server, "GET", "/v1/sessions")[1]["sessions"]}


def assert_forgotten_within(server, session_id: str, within_s: float) -> None:
    """GET answers 404 for the session within ``within_s``."""
    started = time.monotonic()
    while _request(server, "GET", f"/v1/sessions/{session_id}")[0] != 404:
        if time.monotonic() - started > within_s:
            raise AssertionError(f"session still listed {within_s} s after it ended")
        time.sleep(0.05)


def test_a_rest_created_session_reports_its_prompt_length_before_it_starts(server):
    status, created = _request(server, "POST", "/v1/sessions", {"prompt": "a quiet harbour at dawn"})
    assert status == 201
    detail = _request(server, "GET", f"/v1/sessions/{created['session_id']}")[1]
    assert detail["state"] == "created" and detail["prompt_length"] == len("a quiet harbour at dawn")
    assert _request(server, "DELETE", f"/v1/sessions/{created['session_id']}")[0] == 204


def test_sessions_ended_while_attached_are_forgotten_after_the_retention_period(server):
    async def scenario():
        # Ended by a `close` message on the attached socket.
        closer = await StreamClient.open(server.ws_url + "/v1/stream")
        await closer.start("closed by its client", seed=1)
        await closer.chunks(1)
        closed_id = closer.session["session_id"]
        await closer.close()
        detail = _request(server, "GET", f"/v1/sessions/{closed_id}")[1]
        assert detail["state"] == "closed" and detail["close_reason"] == "client"  # still listed, for a while
        # Ended by the engine (its maximum duration) while attached.
        timed = await StreamClient.open(server.ws_url + "/v1/stream")
        await timed.start("ended by the engine", seed=2, pace=True)
        others, code = await timed.until_closed()
        assert others[-1] == {"type": "closed", "reason": "max_duration"} and code == 1000
        return closed_id, timed.session["session_id"]

    closed_id, timed_id = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert_forgotten_within(server, closed_id, within_s=RETENTION_S + MAX_SESSION_S + 5)
    assert_forgotten_within(server, timed_id, within_s=RETENTION_S + 5)
    assert {closed_id, timed_id}.isdisjoint(_listed(server))
    metrics = urllib.request.urlopen(server.base_url + "/metrics", timeout=10).read().decode()
    assert 'arstream_sessions{state="closed"}' not in metrics
    assert "arstream_kv_blocks_in_use 0.0" in metrics.splitlines()
    assert "arstream_decoder_state_bytes 0.0" in metrics.splitlines()
