"""Realtime admission through a real `arstream serve`: live sessions are admitted only while all keep real time.

The engine measures its per-block cost (warm-up blocks, then a running estimate) and admits a live
(paced) session only if every live session keeps its real-time rate with it. Here, on the CPU, at a
small size, the frame rate is chosen from a block's cost measured first, so that two live sessions
would need ~70 % of the device (one block's playback time = 2.9 blocks of device time); N itself is
what the engine then measures and admits, never a constant:

* admitted one at a time, N live sessions get in (N >= 2) and the next is refused at once, decided on
  the engine's live capacity at that moment (its log line) — socket: ``closed`` reason ``capacity``
  with ``retry_after_s``, close 1013; REST: 503 ``capacity`` with ``Retry-After``;
* each admitted session then misses no deadline over 20 chunks, with a best-effort session
  (pacing off) streaming alongside;
* the control: with realtime admission off, N + 1 live sessions (N re-read from the control server's
  own measurement as it fills: the machine's load may have moved since; one more if N + 1 would need
  less than 110 % of the device at its measured block cost) miss deadlines over CONTROL_CHUNKS chunks:
  at 110-120 %, 48 chunks fall 5-10 blocks behind, at least twice the control's pacing lead of 2 (it
  needs no buffer against load bursts: it is meant to miss; with the admitted run's lead of 4, 40 chunks
  at ~108 % fell ~3 behind in one CI run — inside that lead, no miss — so it ran 80 chunks until
  2026-12-02).

It is a timing test on a CPU that may be shared: a sustained rise of the machine's load by more than
about 40 % after admission can still make an admitted session miss; the 4-block pacing lead absorbs
shorter bursts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.error
import urllib.request
from email.message import Message

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.conftest import start_server
from tests.stream_client import StreamClient

HEIGHT = WIDTH = 128
# Device time comes from many denoise steps, not from pixels: on a 2-core CPU the encoder threads would
# otherwise compete with the device thread, and a block would cost more with every session streaming.
TIMESTEPS = [1000.0 - 62.5 * i for i in range(16)]
# Two live sessions need this share of the device at the measured cost: a third tips it over (x 1.5).
# At 0.8 (the admission bound itself, headroom 1.25) an admitted pair missed 2 deadlines in one CI run on a
# loaded 2-core machine (tests took 13 min there, 10 before): 0.7 leaves them 30 % slack; a third (1.05) is
# still refused, and the control adds a fourth to pass 110 %.
TARGET_TWO_SESSION_LOAD = 0.7
CHUNKS = 20
CONTROL_CHUNKS = 48  # long enough that an overloaded device falls further behind than the control's lead
CONTROL_LEAD_CHUNKS = 2
# The control's live sessions need at least this share of the device: N + 1 came to ~108 % in one CI run (the
# machine quieter than when N was measured), ~3 chunks behind over 40 — inside the pacing lead, no miss.
CONTROL_LOAD = 1.1
SETTLE_CHUNKS = 6  # a newcomer streams this long before the next one asks, so the cost estimate sees it
MAX_LIVE = 8  # memory is not the limit here: time is
# Paced sessions run up to this many blocks ahead: the buffer that rides out the load of other
# processes on a shared CPU. An overloaded newcomer starts with no buffer, so it still misses.
LEAD_CHUNKS = 4
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def fps() -> int:
    """A frame rate at which two live sessions load the device ~70 %, from the block cost a server measures
    while one live session streams (what the engine will see, encoder and sockets included)."""
    probe = _server(16, realtime_admission=True)
    try:
        async def measure() -> float:
            client = await _try_live(probe, seed=0)
            await client.chunks(6)
            block_s = _metric(probe, "arstream_block_cost_seconds")
            await client.close()
            return block_s

        block_s = asyncio.run(asyncio.wait_for(measure(), TIMEOUT_S))
    finally:
        probe.stop()
    block_seconds = 2 * block_s / TARGET_TWO_SESSION_LOAD
    return max(4, min(60, round(12 / block_seconds)))


def _server(fps: int, *, realtime_admission: bool, lead_chunks: int = LEAD_CHUNKS):
    env = {
        "ARSTREAM_ENGINE__FPS": str(fps),
        "ARSTREAM_ENGINE__AUDIO": "false",
        "ARSTREAM_ENGINE__TIMESTEPS": json.dumps(TIMESTEPS),
        "ARSTREAM_ENGINE__REALTIME_ADMISSION": "true" if realtime_admission else "false",
    }
    return start_server(
        "--max-sessions", str(MAX_LIVE + 2), "--warmup-blocks", "3", "--height", str(HEIGHT), "--width", str(WIDTH),
        "--lead-chunks", str(lead_chunks),
        env=env,
    )


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


def _metric(server, name: str) -> float:
    for line in _get(server, "/metrics").splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def _detail(server, session_id: str) -> dict:
    return json.loads(_get(server, f"/v1/sessions/{session_id}"))


async def _try_live(server, seed: int) -> StreamClient | tuple[dict, int]:
    """A live session over the socket, streaming; or the refusal (`closed` message, close code)."""
    # max_queue=None: a client the test is not reading (while it admits the next one) keeps taking frames off
    # its socket and so keeps answering the server's keepalive pings; with the default 16-frame queue it
    # stopped reading after ~8 chunks and the server dropped it for a ping timeout (1011) on a slow CPU.
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


async def _admit_until_refused(server) -> tuple[list[StreamClient], tuple[dict, int], int]:
    """Live sessions one at a time until refused; also the live capacity the engine decided the refusal on
    (from its log line: a scrape of /metrics a moment later could already see another estimate)."""
    clients: list[StreamClient] = []
    while len(clients) <= MAX_LIVE:
        outcome = await _try_live(server, seed=len(clients))
        if not isinstance(outcome, StreamClient):
            return clients, outcome, await _refusal_capacity(server)
        clients.append(outcome)
    raise AssertionError(f"more than {MAX_LIVE} live sessions admitted: the engine does not count time")


async def _refusal_capacity(server) -> int:
    """The live capacity the engine logged with its last refusal (the log is read by another thread)."""
    for _ in range(100):
        refusals = [json.loads(line) for line in list(server.log_lines) if '"session refused"' in line]
        if refusals:
            return refusals[-1]["live_capacity"]
        await asyncio.sleep(0.02)
    raise AssertionError("the refusal was not logged")


async def _stream_alongside(clients: list[StreamClient], best_effort: StreamClient | None, chunks: int = 0) -> int:
    """Every live client takes ``chunks`` (CHUNKS) chunks; meanwhile the best-effort one takes what it gets (returned)."""

    async def drain() -> None:
        while True:
            await best_effort.chunks(1)

    background = asyncio.create_task(drain()) if best_effort is not None else None
    try:
        await asyncio.gather(*(client.chunks(chunks or CHUNKS) for client in clients))
    finally:
        if background is not None:
            background.cancel()
            await asyncio.gather(background, return_exceptions=True)
    return len(best_effort.got.chunks) if best_effort is not None else 0


def test_live_sessions_are_admitted_while_all_keep_real_time_and_the_next_is_refused(fps):
    server = _server(fps, realtime_admission=True)
    try:
        async def scenario():
            clients, (closed, code), capacity = await _admit_until_refused(server)
            admitted = len(clients)
            # N comes from the engine's measured cost, and the refusal was decided on it: the live capacity
            # at that moment was the number admitted (less, if the cost rose since the last admission).
            assert admitted >= 2, f"the measured block cost allows only {admitted} live session(s) at {fps} fps"
            assert 1 <= capacity <= admitted
            assert closed["type"] == "closed" and closed["reason"] == "capacity" and code == 1013
            assert closed["retry_after_s"] >= 1.0
            status, headers, body = _post(server, "/v1/sessions", {})
            assert status == 503 and body["error"]["code"] == "capacity"
            assert int(headers["Retry-After"]) >= 1
            assert _metric(server, "arstream_realtime_refusals_total") >= 2

            # A best-effort session (pacing off) is not counted against real time: it is admitted...
            status, _, created = _post(server, "/v1/sessions", {"prompt": "best effort", "options": {"pace": False}})
            assert status == 201
            best_effort = await StreamClient.open(server.ws_url + f"/v1/sessions/{created['session_id']}/stream")
            # ... and streams alongside while no live session misses a deadline.
            best_effort_chunks = await _stream_alongside(clients, best_effort)
            assert best_effort_chunks > 0
            for client in clients:
                detail = _detail(server, client.session["session_id"])
                assert detail["realtime"]["live"] is True
                assert detail["counters"]["chunks"] >= SETTLE_CHUNKS + CHUNKS
                assert detail["realtime"]["deadline_misses"] == 0, (fps, admitted, detail["realtime"])
                assert detail["realtime"]["below_realtime"] is False
            assert _detail(server, created["session_id"])["realtime"]["live"] is False
            assert _metric(server, "arstream_deadline_misses_total") == 0
            block_ms = _metric(server, "arstream_block_cost_seconds") * 1000
            for client in [*clients, best_effort]:
                await client.close()
            print(f"realtime admission: {fps} fps, block {block_ms:.0f} ms, admitted {admitted}, "
                  f"best-effort chunks {best_effort_chunks}")
            return admitted

        asyncio.run(asyncio.wait_for(scenario(), TIMEOUT_S))
    finally:
        server.stop()

    # The control: with realtime admission off, one live session more than was admitted misses deadlines.
    control = _server(fps, realtime_admission=False, lead_chunks=CONTROL_LEAD_CHUNKS)
    try:
        async def overload():
            # N is re-derived here from this server's own measurement (it measures with admission off too),
            # as sessions are added: the machine's load may have moved since the admitted run.
            clients = []

            def overloaded(sessions: int) -> bool:  # their demand at this server's measured block cost
                return sessions * _metric(control, "arstream_block_cost_seconds") >= CONTROL_LOAD * 12 / fps

            while len(clients) <= _metric(control, "arstream_live_session_capacity") or not overloaded(len(clients)):
                outcome = await _try_live(control, len(clients))
                assert isinstance(outcome, StreamClient), "admission is off: every live session gets in"
                clients.append(outcome)
                assert len(clients) <= MAX_LIVE
            await _stream_alongside(clients, None, CONTROL_CHUNKS)
            misses = [_detail(control, c.session["session_id"])["realtime"]["deadline_misses"] for c in clients]
            for client in clients:
                await client.close()
            return misses

        misses = asyncio.run(asyncio.wait_for(overload(), TIMEOUT_S))
        print(f"control: {len(misses)} live sessions without realtime admission missed {misses}")
        assert sum(misses) > 0, misses
    finally:
        control.stop()
