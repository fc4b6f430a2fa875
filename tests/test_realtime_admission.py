"""Realtime admission end to end, through a real `arstream serve`: live sessions are admitted one at a time
until the engine's measured device time is spent, and the next is refused on both surfaces.

The engine measures its block cost (warm-up blocks, then a running estimate) and admits a live (paced)
session only while every live session keeps its real-time rate with it. How many that is depends on this
machine's speed, so the test never fixes it: it admits until refused and checks the refusal against the
live capacity the engine decided it on (its log line). That the admitted ones then keep real time, and one
more would not, is the policy's promise, proven on a virtual device in tests/test_realtime_scheduling.py.

* the refusal: socket ``closed`` reason ``capacity`` with ``retry_after_s``, close 1013; REST 503
  ``capacity`` with ``Retry-After``; both counted in ``arstream_realtime_refusals_total``;
* a best-effort session (pacing off) is not counted against real time: it is admitted, streams alongside,
  and its status says it is not live.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.error
import urllib.request
from email.message import Message

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.conftest import start_server
from tests.stream_client import StreamClient

FPS = 48  # 12 frames a block: 0.25 s of playback, a few of this preset's blocks on a CPU
MAX_SESSIONS = 16  # memory is not the limit here: time is
SETTLE_CHUNKS = 2  # a newcomer streams this long before the next one asks
TIMEOUT_S = 240


def _server():
    env = {"ARSTREAM_ENGINE__FPS": str(FPS), "ARSTREAM_ENGINE__AUDIO": "false",
           "ARSTREAM_ENGINE__REALTIME_ADMISSION": "true"}
    return start_server("--max-sessions", str(MAX_SESSIONS), "--warmup-blocks", "3", env=env)


def _get(server, path: str):
    with urllib.request.urlopen(server.base_url + path, timeout=10) as response:
        return response.read().decode()


def _post(server, path: str, body: dict) -> tuple[int, Message, dict]:
    request = urllib.request.Request(
        server.base_url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, error.headers, json.loads(error.read())


def _delete(server, path: str) -> int:
    request = urllib.request.Request(server.base_url + path, method="DELETE")
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status


def _metric(server, name: str) -> float:
    for line in _get(server, "/metrics").splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def _detail(server, session_id: str) -> dict:
    return json.loads(_get(server, f"/v1/sessions/{session_id}"))


async def _try_live(server, seed: int) -> StreamClient | tuple[dict, int]:
    """A live session over the socket, streaming; or the refusal (`closed` message, close code)."""
    # max_queue=None: a client the test is not reading keeps taking frames off its socket, and so keeps
    # answering the server's keepalive pings.
    ws = await connect(server.ws_url + "/v1/stream", subprotocols=["arstream.v1"], compression=None, max_size=2**24,
                       max_queue=None)
    first = json.loads(await asyncio.wait_for(ws.recv(), 60))
    if first["type"] != "session":
        messages = [first]
        with contextlib.suppress(ConnectionClosed):
            async for message in ws:
                messages.append(json.loads(message))
        return messages[-1], ws.close_code
    client = StreamClient(ws)
    client.session = first
    client.init = await asyncio.wait_for(ws.recv(), 60)
    await client.start(f"live {seed}", seed=seed, pace=True)
    await client.chunks(SETTLE_CHUNKS)
    return client


async def _refusal_capacity(server) -> int:
    """The live capacity the engine logged with its last refusal (a scrape of /metrics a moment later could
    already see another estimate; the log is read by another thread)."""
    for _ in range(100):
        refusals = [json.loads(line) for line in list(server.log_lines) if '"session refused"' in line]
        if refusals:
            return refusals[-1]["live_capacity"]
        await asyncio.sleep(0.02)
    raise AssertionError("the refusal was not logged")


def test_live_sessions_are_admitted_until_the_measured_device_time_is_spent_and_the_next_is_refused():
    server = _server()
    try:
        async def scenario():
            clients: list[StreamClient] = []
            while True:
                outcome = await _try_live(server, seed=len(clients))
                if not isinstance(outcome, StreamClient):
                    break
                clients.append(outcome)
                assert len(clients) <= MAX_SESSIONS - 2, "live sessions admitted by memory alone: time is not counted"
            closed, code = outcome
            admitted = len(clients)
            # Refused at the live capacity the engine measured then: the number admitted (fewer if the cost rose).
            capacity = await _refusal_capacity(server)
            assert 1 <= capacity <= len(clients)
            assert closed["type"] == "closed" and closed["reason"] == "capacity" and code == 1013
            assert closed["retry_after_s"] >= 1.0
            # Over REST too. The running estimate may have moved since (a busy machine's blocks vary): a live
            # session created meanwhile fits the new estimate and holds its share, so the next one is refused.
            fitted = []
            for _ in range(MAX_SESSIONS):
                status, headers, body = _post(server, "/v1/sessions", {})
                if status != 201:
                    break
                fitted.append(body["session_id"])
            assert status == 503 and body["error"]["code"] == "capacity" and int(headers["Retry-After"]) >= 1
            assert len(clients) + len(fitted) <= MAX_SESSIONS - 2, "live sessions admitted by memory alone"
            assert _metric(server, "arstream_realtime_refusals_total") >= 2
            for session_id in fitted:
                _delete(server, f"/v1/sessions/{session_id}")

            # A best-effort session is not counted against real time: admitted although the live capacity is
            # full, it streams alongside in the time live sessions leave. At full capacity that may be none (the
            # scheduler serves best effort last, by design: it starved here now and then), so one live session
            # leaves first and the others keep streaming.
            await clients.pop().close()
            status, _, created = _post(server, "/v1/sessions", {"prompt": "best effort", "options": {"pace": False}})
            assert status == 201
            best_effort = await StreamClient.open(server.ws_url + f"/v1/sessions/{created['session_id']}/stream")
            # ... and so is one a socket asks for at connect (`?pace=false`): the live capacity is full, it is not.
            socket_best = await StreamClient.open(server.ws_url + "/v1/stream?pace=false")
            await socket_best.start("best effort by socket", seed=99, pace=False)
            await asyncio.gather(best_effort.chunks(3), socket_best.chunks(2), *(client.chunks(1) for client in clients))
            assert _detail(server, created["session_id"])["realtime"]["live"] is False
            assert _detail(server, socket_best.session["session_id"])["realtime"]["live"] is False
            await socket_best.close()
            for client in clients:
                realtime = _detail(server, client.session["session_id"])["realtime"]
                assert realtime["live"] is True and realtime["live_capacity"] is not None
            for client in [*clients, best_effort]:
                await client.close()
            print(f"realtime admission: {FPS} fps, block {_metric(server, 'arstream_block_cost_seconds') * 1000:.0f} ms, "
                  f"admitted {admitted}, refused at a live capacity of {capacity}")

        asyncio.run(asyncio.wait_for(scenario(), TIMEOUT_S))
    finally:
        server.stop()
