"""One host, N devices: a real front end (`arstream serve --devices cpu,cpu`) with two real CPU workers.

Everything is a real process: the front end, its two `tiny` workers (one torch thread each), and the
WebSocket/REST clients here. Admission is by slots (`--max-sessions 1` per worker, so two sessions fill the
cluster): two workers sharing this machine's two cores cannot each keep real time, and with no warm-up
block nothing is measured, so realtime admission admits by memory alone (docs/ENGINE.md).

Which worker a session landed on is read from the front end's own log (`session placed`, with the
worker's name; `worker started`, with its pid): the wire protocol does not show it, by design.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.conftest import SMALL_ENGINE, decode_mp4, follow_serving_url
from tests.raw_ws import RawWebSocket
from tests.server_zygote import ForkedServer

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 180
RECEIVE_TIMEOUT_S = 60
# Fast polls and restarts for the test (each a validated setting: docs/SCALE_OUT.md).
CLUSTER_ENV = {
    "ARSTREAM_CLUSTER__CAPACITY_POLL_S": "0.2",
    "ARSTREAM_CLUSTER__RECONCILE_S": "1.0",
    "ARSTREAM_CLUSTER__RESTART_BACKOFF_S": "0.2",
}


@dataclass
class FrontEnd:
    process: ForkedServer
    base_url: str = ""
    lines: list[str] = field(default_factory=list)

    @property
    def ws_url(self) -> str:
        return "ws" + self.base_url[len("http"):]

    def events(self, event: str) -> list[dict]:
        """The front end's own JSON log records with this event (worker lines carry a `worker` field too,
        but come from the workers' loggers)."""
        found = []
        for line in list(self.lines):
            if not line.startswith("{"):
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == event and record.get("logger") == "arstream.cluster":
                found.append(record)
        return found

    async def worker_of(self, session_id: str, timeout_s: float = 10.0) -> str:
        """The worker the front end placed the session on (its log line may trail the answer a little)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for record in self.events("session placed"):
                if record["session_id"] == session_id:
                    return record["worker"]
            await asyncio.sleep(0.05)
        raise AssertionError(f"no placement logged for {session_id}")

    def worker_pid(self, name: str) -> int:
        started = [r for r in self.events("worker started") if r["worker"] == name]
        return max(started, key=lambda r: r["generation"])["pid"]

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_front_end(*extra: str) -> FrontEnd:
    args = [
        "serve", "--devices", "cpu,cpu", "--host", "127.0.0.1", "--port", "0",
        "--log-format", "json", "--preset", "tiny", "--random-weights",
        "--height", str(SMALL_ENGINE["height"]), "--width", str(SMALL_ENGINE["width"]), "--cpu-threads", "1",
        "--warmup-blocks", "0", "--sink-frames", str(SMALL_ENGINE["sink_frames"]),
        "--window-frames", str(SMALL_ENGINE["window_frames"]), "--max-sessions", "1", *extra,
    ]
    env = {**os.environ, **CLUSTER_ENV, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    process = ForkedServer(args, env)  # the front end forked warm (tests/server_zygote.py); its workers start cold
    front = FrontEnd(process)
    serving = r"^arstream serving on (http://\S+)"
    front.base_url = follow_serving_url(process, front.lines, START_TIMEOUT_S, serving) or ""
    if not front.base_url:
        front.stop(5)
        raise RuntimeError("the front end did not start:\n" + "\n".join(front.lines[-40:]))
    wait_until(lambda: _metric(front, 'arstream_worker_ready{worker="cpu-0"}') == 1
               and _metric(front, 'arstream_worker_ready{worker="cpu-1"}') == 1, START_TIMEOUT_S, front)
    return front


def wait_until(condition, timeout_s: float, front: FrontEnd | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            tail = "\n".join(front.lines[-30:]) if front is not None else ""
            raise AssertionError(f"not within {timeout_s} s\n{tail}")
        time.sleep(0.1)


def _metric(front: FrontEnd, name: str) -> float | None:
    try:
        text = httpx.get(front.base_url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.fixture(scope="module")
def front():
    running = start_front_end()
    try:
        yield running
    finally:
        running.stop()


def run(coroutine, timeout_s: float = 240):
    return asyncio.run(asyncio.wait_for(coroutine, timeout_s))


# --- a protocol client --------------------------------------------------------------------------------


class Stream:
    """One client socket: `session` + init, then chunk/segment pairs, with every other message kept."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.session: dict = {}
        self.init = b""
        self.chunks: list[dict] = []
        self.segments: list[bytes] = []
        self.arrivals: list[float] = []
        self.others: list[dict] = []

    @classmethod
    async def open(cls, url: str) -> Stream:
        # No pings of its own (ping_interval=None): on a loaded 2-core machine a pong can take longer than
        # websockets' 20 s, and the client then closed b's socket itself (one CI run); the server's pings are
        # still answered, and b's liveness is what the chunk gaps assert.
        stream = cls(await connect(url, subprotocols=["arstream.v1"], compression=None, max_size=2**24,
                                   ping_interval=None))
        first = await stream._text()
        if first["type"] == "session":
            stream.session = first
            stream.init = await asyncio.wait_for(stream.ws.recv(), RECEIVE_TIMEOUT_S)
            assert isinstance(stream.init, bytes) and stream.init[4:8] == b"ftyp"
        else:
            stream.others.append(first)
        return stream

    @property
    def session_id(self) -> str:
        return self.session["session_id"]

    async def _text(self) -> dict:
        message = await asyncio.wait_for(self.ws.recv(), RECEIVE_TIMEOUT_S)
        assert isinstance(message, str), "expected a text message"
        return json.loads(message)

    async def send(self, **message) -> None:
        await self.ws.send(json.dumps(message))

    async def start(self, prompt: str, seed: int) -> None:
        await self.send(type="start", prompt=prompt, seed=seed, id="start")
        await self.until(lambda m: m["type"] == "ack" and m.get("id") == "start")

    async def next(self) -> dict | None:
        """One message: a chunk (with its segment) is kept and returns None; anything else is returned."""
        message = await self._text()
        if message["type"] != "chunk":
            self.others.append(message)
            return message
        segment = await asyncio.wait_for(self.ws.recv(), RECEIVE_TIMEOUT_S)
        assert isinstance(segment, bytes), "a chunk message must be followed by its segment"
        self.chunks.append(message)
        self.segments.append(segment)
        self.arrivals.append(time.monotonic())
        return None

    async def until(self, matches) -> dict:
        while True:
            message = await self.next()
            if message is not None and matches(message):
                return message

    async def chunks_more(self, count: int) -> None:
        target = len(self.chunks) + count
        while len(self.chunks) < target:
            await self.next()

    async def until_closed(self) -> int:
        """Read to the end; the close code."""
        try:
            while True:
                await self.next()
        except ConnectionClosed:
            pass
        return self.ws.close_code

    async def close(self) -> None:
        await self.send(type="close")
        assert await self.until_closed() == 1000
        assert self.others[-1] == {"type": "closed", "reason": "client"}


# --- the tests ----------------------------------------------------------------------------------------


def test_sessions_spread_and_rest_and_reattach_reach_their_worker_and_a_full_cluster_refuses(front):
    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=front.base_url, timeout=30) as rest:
            a = await Stream.open(front.ws_url + "/v1/stream")
            b = await Stream.open(front.ws_url + "/v1/stream")
            assert a.session["state"] == b.session["state"] == "created"
            worker_a, worker_b = await front.worker_of(a.session_id), await front.worker_of(b.session_id)
            assert {worker_a, worker_b} == {"cpu-0", "cpu-1"}, "the two sessions share a worker"
            await a.start("a red kite", seed=1)
            await b.start("a blue boat", seed=2)
            await a.chunks_more(1)
            await b.chunks_more(1)

            # Both workers are full (one slot each): the next session is refused as by a single full engine.
            c = await Stream.open(front.ws_url + "/v1/stream")
            assert await c.until_closed() == 1013
            assert c.others[-1]["type"] == "closed" and c.others[-1]["reason"] == "capacity"
            assert c.others[-1]["retry_after_s"] >= 1
            refused = await rest.post("/v1/sessions", json={})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "capacity"
            assert int(refused.headers["retry-after"]) >= 1

            # REST reaches the session's own worker (the other one would answer 404).
            for stream in (a, b):
                detail = await rest.get(f"/v1/sessions/{stream.session_id}")
                assert detail.status_code == 200, detail.text
                assert detail.json()["session_id"] == stream.session_id and detail.json()["state"] == "active"
            listed = (await rest.get("/v1/sessions")).json()["sessions"]
            assert {s["session_id"] for s in listed} == {a.session_id, b.session_id}
            paused = await rest.post(f"/v1/sessions/{a.session_id}/pause")
            assert paused.status_code == 200 and paused.json() == {"session_id": a.session_id, "state": "paused"}
            assert await a.until(lambda m: m["type"] == "state") == {"type": "state", "state": "paused"}
            resumed = await rest.post(f"/v1/sessions/{a.session_id}/resume")
            assert resumed.json()["state"] == "active"
            assert await a.until(lambda m: m["type"] == "state") == {"type": "state", "state": "active"}
            prompted = await rest.post(f"/v1/sessions/{a.session_id}/prompt", json={"prompt": "a green kite"})
            assert prompted.status_code == 200, prompted.text
            assert (await rest.post(f"/v1/sessions/{b.session_id}/reset")).status_code == 200
            bad = await rest.post(f"/v1/sessions/{a.session_id}/prompt", json={"prompt": "   "})
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_field"
            assert (await rest.get("/v1/sessions/nosuchsession")).status_code == 404

            # Re-attach by id reaches b's worker: the first socket is told `replaced`, the new one streams on.
            b2 = await Stream.open(front.ws_url + f"/v1/sessions/{b.session_id}/stream")
            assert b2.session["session_id"] == b.session_id
            assert await b.until_closed() == 1000 and b.others[-1] == {"type": "closed", "reason": "replaced"}
            await b2.chunks_more(2)
            frames, _ = decode_mp4(b2.init + b"".join(b2.segments))
            assert frames.shape[1:] == (SMALL_ENGINE["height"], SMALL_ENGINE["width"], 3)
            unknown = await connect(front.ws_url + "/v1/sessions/nosuchsession/stream")
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(unknown.recv(), RECEIVE_TIMEOUT_S)
            assert unknown.close_code == 4404

            # DELETE reaches a's worker and frees its slot: a new session is admitted there, and only there.
            assert (await rest.delete(f"/v1/sessions/{a.session_id}")).status_code == 204
            assert await a.until_closed() == 1000 and a.others[-1] == {"type": "closed", "reason": "client"}
            assert (await rest.get(f"/v1/sessions/{a.session_id}")).status_code == 404
            created = await rest.post("/v1/sessions", json={"prompt": "a yellow kite", "seed": 3})
            assert created.status_code == 201, created.text
            new_id = created.json()["session_id"]
            assert created.json()["stream_url"] == front.ws_url + f"/v1/sessions/{new_id}/stream"
            assert await front.worker_of(new_id) == worker_a
            d = await Stream.open(created.json()["stream_url"])
            assert d.session["session_id"] == new_id
            await d.chunks_more(1)  # a prompt in the body: it starts on attach

            metrics = (await rest.get("/metrics")).text
            for worker in ("cpu-0", "cpu-1"):
                assert f'arstream_worker_up{{worker="{worker}"}} 1.0' in metrics
                assert f'arstream_worker_open_sessions{{worker="{worker}"}}' in metrics
            assert 'arstream_worker_sessions_placed_total{worker="' + worker_a + '"} 2.0' in metrics
            for stream in (b2, d):
                await stream.close()

    run(scenario())


def test_a_killed_worker_ends_only_its_sessions_and_comes_back(front):
    async def scenario() -> None:
        readiness: list[int] = []
        async with httpx.AsyncClient(base_url=front.base_url, timeout=30) as rest:
            await _wait_for_empty_workers(rest)
            a = await Stream.open(front.ws_url + "/v1/stream")
            b = await Stream.open(front.ws_url + "/v1/stream")
            worker_a, worker_b = await front.worker_of(a.session_id), await front.worker_of(b.session_id)
            assert worker_a != worker_b
            await a.start("a red kite", seed=1)
            await b.start("a blue boat", seed=2)
            await a.chunks_more(1)
            await b.chunks_more(2)

            polling = True

            async def poll_readiness() -> None:
                while polling:
                    readiness.append((await rest.get("/readyz")).status_code)
                    await asyncio.sleep(0.05)

            poller = asyncio.ensure_future(poll_readiness())
            b_reader = asyncio.ensure_future(b.chunks_more(10**6))  # b reads on, chunk after chunk
            chunks_before = len(b.chunks)
            killed_at = time.monotonic()
            os.kill(front.worker_pid(worker_a), signal.SIGKILL)

            assert await a.until_closed() == 1011
            assert a.others[-2:] == [{"type": "error", "code": "internal", "message": "the engine worker failed"},
                                     {"type": "closed", "reason": "failed"}]
            failed_after_s = time.monotonic() - killed_at
            missing = await rest.get(f"/v1/sessions/{a.session_id}")
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_session"

            # The worker comes back as a new generation and admits again: b's worker is full, so the
            # newcomer can only go there.
            # (Waited for without blocking this event loop: the clients here must keep answering pings.)
            for _ in range(1200):
                metrics = (await rest.get("/metrics")).text
                if (f'arstream_worker_generation{{worker="{worker_a}"}} 2.0' in metrics
                        and f'arstream_worker_admitting{{worker="{worker_a}"}} 1.0' in metrics):
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError(f"{worker_a} did not come back within 120 s")
            back_after_s = time.monotonic() - killed_at
            c = await Stream.open(front.ws_url + "/v1/stream")
            assert c.session.get("type") == "session", c.others
            assert await front.worker_of(c.session_id) == worker_a
            await c.start("a yellow kite", seed=3)
            await c.chunks_more(1)

            await asyncio.sleep(1.0)  # b keeps streaming after all that
            polling = False
            await poller
            assert not b_reader.done(), "b's socket ended"
            b_reader.cancel()
            # Wait for the reader to be gone: b.close() reads the same socket, which allows one reader at a time.
            with contextlib.suppress(asyncio.CancelledError):
                await b_reader
            indices = [chunk["index"] for chunk in b.chunks]
            assert indices == list(range(indices[0], indices[0] + len(indices))), "b lost chunks"
            assert len(b.chunks) - chunks_before >= 3
            gaps = [later - earlier for earlier, later in zip(b.arrivals, b.arrivals[1:])]
            assert max(gaps) < 5.0, f"b stalled for {max(gaps):.1f} s"
            # b's worker stayed ready (though full) all along: readiness never dropped.
            assert readiness and set(readiness) == {200}, readiness

            metrics = (await rest.get("/metrics")).text
            assert f'arstream_worker_restarts_total{{worker="{worker_a}"}} 1.0' in metrics
            assert f'arstream_worker_lost_total{{worker="{worker_a}"}} 1.0' in metrics
            assert f'arstream_worker_lost_total{{worker="{worker_b}"}} 0.0' in metrics
            assert "arstream_sessions_failed_by_worker_loss_total 1.0" in metrics
            for stream in (b, c):
                await stream.close()
            print(f"failed {failed_after_s:.2f} s after the kill; worker admitting again after {back_after_s:.1f} s; "
                  f"b: {len(b.chunks) - chunks_before} chunks meanwhile, largest gap {max(gaps):.2f} s; "
                  f"{len(readiness)} readiness polls, all 200")

    run(scenario())


def test_a_client_that_stops_reading_holds_back_only_its_own_session(front):
    """Through the relay, a reader that stops is detached by its worker as a direct one would be (pings or
    stalled delivery) after a bounded number of chunks: the front end buffers little of its own."""
    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=front.base_url, timeout=30) as rest:
            await _wait_for_empty_workers(rest)
            stalled = RawWebSocket(front.ws_url + "/v1/stream", receive_buffer_bytes=4096)
            stalled_id = json.loads(stalled.receive())["session_id"]
            stalled.receive()  # init
            stalled.send_json({"type": "start", "prompt": "a viewer who walks away", "seed": 3,
                               "options": {"pace": False}})
            taken = 0
            while taken < 3:  # read a few chunks, then stop reading for good
                message = stalled.receive()
                if isinstance(message, bytes):
                    taken += 1
            stopped_at = time.monotonic()
            made_at_stop = (await rest.get(f"/v1/sessions/{stalled_id}")).json()["counters"]["chunks"]

            healthy = await Stream.open(front.ws_url + "/v1/stream")
            assert await front.worker_of(healthy.session_id) != await front.worker_of(stalled_id)
            await healthy.send(type="start", prompt="a healthy viewer", seed=4, options={"pace": False})
            state = "active"
            while state != "detached":
                await healthy.chunks_more(1)
                detail = (await rest.get(f"/v1/sessions/{stalled_id}")).json()
                state = detail["state"]
                assert time.monotonic() - stopped_at < 30, "the stalled reader was never detached"
            detached_after_s = time.monotonic() - stopped_at
            made_after_stop = detail["counters"]["chunks"] - made_at_stop
            healthy_before = len(healthy.chunks)
            await healthy.chunks_more(5)  # and the healthy session streams on
            assert made_after_stop <= 40, f"{made_after_stop} chunks made for a reader that had stopped"
            assert (await rest.delete(f"/v1/sessions/{stalled_id}")).status_code == 204
            await healthy.close()
            stalled.close()
            print(f"stalled reader detached {detached_after_s:.1f} s after it stopped, {made_after_stop} chunks "
                  f"made meanwhile; healthy: {healthy_before} chunks meanwhile")

    run(scenario())


def test_a_webrtc_offer_through_the_front_end_is_answered_by_a_worker_that_streams_to_the_peer(front):
    """`POST /v1/webrtc` to the front end: placed as a REST or socket session is, the worker that admits it answers
    (its resource and session id come back through the front end), the peer connects to that worker directly and
    streams; `DELETE` through the front end ends the session."""
    from tests.webrtc_peer import Peer

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=front.base_url, timeout=30) as rest:
            await _wait_for_empty_workers(rest)
            assert (await rest.options("/v1/webrtc")).status_code == 204  # no STUN/TURN configured: no Link
            peer = Peer()
            answer = await peer.connect(front.base_url)
            assert answer.status_code == 201, answer.text
            session_id = answer.headers["x-session-id"]
            assert answer.headers["location"] == f"/v1/sessions/{session_id}/webrtc"
            assert await front.worker_of(session_id) in ("cpu-0", "cpu-1")
            hello = await peer.wait_for(lambda m: m["type"] == "session")
            assert hello["session_id"] == session_id and hello["transport"] == "webrtc"
            peer.send(type="start", prompt="a peer through the front end", seed=5, id="s")
            await peer.wait_for(lambda m: m["type"] == "chunk")
            while len(peer.frames) < 4:
                await asyncio.sleep(0.05)
            assert (await rest.delete(answer.headers["location"])).status_code == 204
            closed = await peer.wait_for(lambda m: m["type"] == "closed")
            await peer.close()
            assert closed["reason"] == "client"

    run(scenario())


def test_sigterm_drains_relayed_clients_with_closed_and_1001(front):
    """Last in this module: it stops the front end (and with it, both workers)."""
    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=front.base_url, timeout=30) as rest:
            await _wait_for_empty_workers(rest)
        a = await Stream.open(front.ws_url + "/v1/stream")
        await a.start("a red kite", seed=1)
        await a.chunks_more(1)
        front.process.send_signal(signal.SIGTERM)
        assert await a.until_closed() == 1001
        assert a.others[-1]["type"] == "closed" and a.others[-1]["reason"] == "draining"

    run(scenario())
    front.process.wait(timeout=60)
    assert front.process.returncode in (0, -15)
    exited = {r["worker"] for r in front.events("worker exited")}
    assert exited == {"cpu-0", "cpu-1"}


async def _wait_for_empty_workers(rest: httpx.AsyncClient) -> None:
    """Sessions of an earlier test are gone from both workers (their slots are free)."""
    for _ in range(200):
        text = (await rest.get("/metrics")).text
        if all(f'arstream_worker_slots_free{{worker="{w}"}} 1.0' in text for w in ("cpu-0", "cpu-1")):
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the workers still hold sessions")
