"""Chaos: many sessions doing everything a client can, in random order, against a real server;
afterwards nothing is left behind.

Each session takes a random path through create (socket or REST, with or without a prompt), start,
prompt changes of every policy, reset, pause/resume (socket and REST), replace (a second socket), drop
(connection lost) and reconnect, and ends by a `close` message, REST DELETE, a drop left to time out,
or eviction by a newcomer (capacity is kept scarce on purpose). When all is done and the retention
time has passed: no session listed, no KV block in use, no decoder state held, no socket open — each
a leak of the first session that leaked, whatever the run's length.

A slow leak of memory shows only over a long run: the slow test (``ARSTREAM_SLOW_TESTS=1``, 2,000
sessions) also checks that the server's RSS did not grow by more than 20 KiB per session in both of the
run's last two quarters (a leak grows in each; a one-off allocator step shows in one).
``ARSTREAM_CHAOS_SESSIONS`` (default 80) sizes the suite's run; every path above happens in it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.conftest import start_server

MAX_SESSIONS = 4
WORKERS = 6  # more clients than slots: refusals and evictions happen
GRACE_S = 0.5
RETENTION_S = 0.5
RECEIVE_TIMEOUT_S = 30
RSS_GROWTH_PER_SESSION_BYTES = 20 * 1024
POLICIES = ("soft", "recache", "reset")


def rest(base_url: str, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else {}
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def metrics(base_url: str) -> dict[str, float]:
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        match = re.fullmatch(r"(arstream_[a-z_]+) (\S+)", line)
        if match:
            values[match.group(1)] = float(match.group(2))
    return values


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE).group(1)) * 1024


def open_sockets(pid: int) -> int:
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            count += os.readlink(fd).startswith("socket:")
        except OSError:
            pass  # closed meanwhile
    return count


class Chaos:
    def __init__(self, server, sessions: int, seed: int) -> None:
        self.server = server
        self.base = server.base_url
        self.target = sessions
        self.created = 0
        self.random = random.Random(seed)
        self.ops: Counter[str] = Counter()

    async def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        return await asyncio.to_thread(rest, self.base, method, path, body)

    async def open(self, path: str):
        """A socket and its `session` message (the init segment read too); None when refused."""
        try:
            ws = await connect(self.server.ws_url + path, compression=None, max_size=2**24, open_timeout=30)
        except InvalidStatus:
            return None, None
        try:
            hello = json.loads(await asyncio.wait_for(ws.recv(), RECEIVE_TIMEOUT_S))
            if hello["type"] != "session":
                await ws.close()
                return None, hello
            await asyncio.wait_for(ws.recv(), RECEIVE_TIMEOUT_S)  # init segment
            return ws, hello
        except ConnectionClosed:
            return None, None

    async def next_control(self, ws, wanted: str | None = None) -> dict:
        """The next message that is not a chunk (chunks and their segments are read and dropped)."""
        while True:
            message = json.loads(await asyncio.wait_for(ws.recv(), RECEIVE_TIMEOUT_S))
            if message["type"] == "chunk":
                await asyncio.wait_for(ws.recv(), RECEIVE_TIMEOUT_S)
                continue
            if wanted is None or message["type"] == wanted or message["type"] in ("error", "closed"):
                return message

    async def chunks(self, ws, count: int) -> None:
        seen = 0
        while seen < count:
            message = json.loads(await asyncio.wait_for(ws.recv(), RECEIVE_TIMEOUT_S))
            if message["type"] == "chunk":
                await asyncio.wait_for(ws.recv(), RECEIVE_TIMEOUT_S)
                seen += 1
            elif message["type"] == "closed":
                raise ConnectionClosed(None, None)

    async def control(self, ws, message: dict) -> dict:
        await ws.send(json.dumps({**message, "id": "c"}))
        return await self.next_control(ws, "ack")

    async def worker(self) -> None:
        while self.created < self.target:
            try:
                await self.one_session()
            except (ConnectionClosed, TimeoutError, OSError):
                self.ops["connection_lost"] += 1

    async def one_session(self) -> None:
        pick = self.random
        via_rest = pick.random() < 0.4
        if via_rest:
            body = {"prompt": "chaos by rest", "seed": pick.randrange(1000), "options": {"pace": False}} \
                if pick.random() < 0.5 else None
            status, created = await self.call("POST", "/v1/sessions", body)
            if status != 201:
                self.ops["refused"] += 1
                await asyncio.sleep(0.05)
                return
            session_id, started = created["session_id"], body is not None
            self.count_created()
            if pick.random() < 0.1:  # created and never attached: it times out or is deleted
                await self.call("DELETE", f"/v1/sessions/{session_id}")
                self.ops["delete_unattached"] += 1
                return
            ws, hello = await self.open(f"/v1/sessions/{session_id}/stream")
        else:
            ws, hello = await self.open("/v1/stream")
            started = False
            if ws is None:
                self.ops["refused"] += 1
                await asyncio.sleep(0.05)
                return
            session_id = hello["session_id"]
            self.count_created()
        if ws is None:
            self.ops["gone_before_attach"] += 1
            return
        try:
            if not started:
                await self.control(ws, {"type": "start", "prompt": "chaos", "seed": pick.randrange(1000),
                                        "options": {"pace": False}})
            await self.chunks(ws, 1)
            for _ in range(pick.randint(1, 4)):
                ws = await self.random_op(ws, session_id)
                if ws is None:
                    return
            await self.end(ws, session_id)
        finally:
            if ws is not None:
                await ws.close()

    async def random_op(self, ws, session_id: str):
        pick = self.random
        op = pick.choice(["prompt", "reset", "pause_resume", "rest_control", "replace", "drop_reconnect"])
        self.ops[op] += 1
        if op == "prompt":
            await self.control(ws, {"type": "prompt", "prompt": "changed", "policy": pick.choice(POLICIES)})
            await self.chunks(ws, 1)
        elif op == "reset":
            await self.control(ws, {"type": "reset"})
        elif op == "pause_resume":
            await self.control(ws, {"type": "pause"})
            await self.control(ws, {"type": "resume"})
        elif op == "rest_control":
            action = pick.choice(["pause", "resume", "reset"])
            await self.call("POST", f"/v1/sessions/{session_id}/{action}")
            if action == "pause":
                await self.call("POST", f"/v1/sessions/{session_id}/resume")
        elif op == "replace":
            newcomer, hello = await self.open(f"/v1/sessions/{session_id}/stream")
            await self.until_closed(ws)  # told `replaced`
            if newcomer is None:
                self.ops["evicted"] += hello is not None and hello.get("code") == "session_closed"
            return newcomer
        elif op == "drop_reconnect":
            ws.transport.abort()  # the connection is lost, not closed
            await asyncio.sleep(pick.uniform(0, GRACE_S / 2))
            again, hello = await self.open(f"/v1/sessions/{session_id}/stream")
            if again is None:  # a newcomer took its slot meanwhile
                self.ops["evicted"] += hello is not None and hello.get("code") == "session_closed"
            return again
        return ws

    async def end(self, ws, session_id: str) -> None:
        pick = self.random
        how = pick.choice(["close", "delete", "drop", "pause_and_drop"])
        self.ops[f"end_{how}"] += 1
        if how == "close":
            await ws.send(json.dumps({"type": "close"}))
            await self.until_closed(ws)
        elif how == "delete":
            await self.call("DELETE", f"/v1/sessions/{session_id}")
            await self.until_closed(ws)
        elif how == "drop":
            ws.transport.abort()  # ends idle_timeout after the grace period, or evicted before
        else:  # paused and detached: the first candidate for eviction
            await self.control(ws, {"type": "pause"})
            ws.transport.abort()

    async def until_closed(self, ws) -> None:
        try:
            while True:
                await asyncio.wait_for(ws.recv(), RECEIVE_TIMEOUT_S)
        except ConnectionClosed:
            pass

    def count_created(self) -> None:
        self.created += 1
        if os.environ.get("ARSTREAM_CHAOS_TRACE") and self.created % 100 == 0:
            print(f"  {self.created} sessions: RSS {rss_bytes(self.server.process.pid) / 2**20:.1f} MiB", flush=True)

    async def run(self, until_created: int) -> None:
        self.target = until_created
        await asyncio.gather(*(self.worker() for _ in range(WORKERS)))


TRIM_WAIT_S = 6.0  # the server returns freed memory to the OS at most every 5 s (app/memory.py)


def settle(base_url: str, baseline: dict[str, float], *, trim: bool, timeout_s: float = 60.0) -> dict[str, float]:
    """Wait until every session ended and was forgotten (``trim``: and the server trimmed its heap since, for
    an RSS reading); the server's counters then."""
    deadline = time.monotonic() + timeout_s
    while True:
        listed = rest(base_url, "GET", "/v1/sessions")[1]["sessions"]
        now = metrics(base_url)
        if not listed and now.get("arstream_websockets_open") == baseline.get("arstream_websockets_open"):
            if trim:
                time.sleep(TRIM_WAIT_S)
            return now
        if time.monotonic() > deadline:
            raise AssertionError(f"still listed after the chaos: {listed}")
        time.sleep(0.2)


def idle_sockets(pid: int) -> int:
    """The server's sockets at rest: the listener and the event loop's own pair (an HTTP connection
    of the readiness poll may still be closing)."""
    time.sleep(1.0)
    return min(open_sockets(pid) for _ in range(5) if not time.sleep(0.1))


def settled_sockets(pid: int, baseline: int, timeout_s: float = 15.0) -> int:
    """The server's open sockets once closing handshakes finished (uvicorn waits up to 10 s for a
    peer's close reply before it drops the connection)."""
    deadline = time.monotonic() + timeout_s
    while (count := open_sockets(pid)) != baseline and time.monotonic() < deadline:
        time.sleep(0.2)
    return count


def run_chaos(sessions: int, seed: int, *, rss_trend: bool = False) -> tuple[Chaos, dict]:
    """``rss_trend``: run in three parts (the first half, then two quarters), each left to settle, and take the
    server's RSS after each, so RSS is compared between like states (nothing open)."""
    server = start_server(
        "--max-sessions", str(MAX_SESSIONS), "--detach-grace-s", str(GRACE_S),
        env={"ARSTREAM_CLOSED_RETENTION_S": str(RETENTION_S), "ARSTREAM_CONTROL_RATE_PER_S": "1000",
             "ARSTREAM_CONTROL_BURST": "1000"},
    )
    try:
        pid = server.process.pid
        baseline = metrics(server.base_url)
        baseline_sockets = idle_sockets(pid)
        chaos = Chaos(server, sessions, seed)
        started = time.monotonic()
        checkpoints = []  # (sessions created, RSS) after each part
        for target in ((sessions // 2, (3 * sessions) // 4, sessions) if rss_trend else (sessions,)):
            asyncio.run(asyncio.wait_for(chaos.run(target), 3600))
            after = settle(server.base_url, baseline, trim=rss_trend)
            checkpoints.append((chaos.created, rss_bytes(pid)))
        figures = {
            "seconds": time.monotonic() - started,
            "baseline": baseline,
            "after": after,
            "sockets_before": baseline_sockets,
            "sockets_after": settled_sockets(pid, baseline_sockets),
            "checkpoints": checkpoints,
        }
    finally:
        server.stop()
    rss = " -> ".join(f"{r / 2**20:.1f}" for _, r in figures["checkpoints"])
    print(f"chaos: {chaos.created} sessions in {figures['seconds']:.1f} s; ops {dict(chaos.ops)}; RSS {rss} MiB")
    return chaos, figures


def check(chaos: Chaos, figures: dict) -> None:
    baseline, after = figures["baseline"], figures["after"]
    assert chaos.created >= chaos.target
    assert after["arstream_kv_blocks_in_use"] == 0 == baseline["arstream_kv_blocks_in_use"]
    assert after["arstream_websockets_open"] == baseline["arstream_websockets_open"] == 0
    if "arstream_decoder_state_bytes" in baseline:  # exposed by the engine's metrics
        assert after["arstream_decoder_state_bytes"] == baseline["arstream_decoder_state_bytes"] == 0
    assert figures["sockets_after"] == figures["sockets_before"], "a connection was left open"
    for op in ("prompt", "reset", "pause_resume", "rest_control", "replace", "drop_reconnect",
               "end_close", "end_delete", "end_drop", "end_pause_and_drop"):
        assert chaos.ops[op] > 0, (op, chaos.ops)


def check_rss_trend(figures: dict) -> None:
    # A leak grows RSS in every quarter; a one-off step (an allocator arena, a bounded cache reaching its
    # bound) shows in one. One CI run saw +7.1 MiB over a whole second half of 249 sessions, and the
    # same code shrank over it in the others.
    quarters = [(n1 - n0, r1 - r0) for (n0, r0), (n1, r1) in zip(figures["checkpoints"], figures["checkpoints"][1:])]
    over = [(n, growth) for n, growth in quarters if growth > RSS_GROWTH_PER_SESSION_BYTES * n]
    assert len(over) < len(quarters), "RSS grew in every quarter: " + ", ".join(
        f"{growth / 1024:.0f} KiB over {n} sessions" for n, growth in quarters)


def test_chaos_sessions_leave_nothing_behind():
    chaos, figures = run_chaos(int(os.environ.get("ARSTREAM_CHAOS_SESSIONS", "80")), seed=9)
    check(chaos, figures)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("ARSTREAM_SLOW_TESTS"), reason="2,000 sessions: ~5 min on the shared CPU (ARSTREAM_SLOW_TESTS=1 runs it)")
def test_long_chaos_run_leaves_nothing_behind_and_memory_does_not_grow():
    chaos, figures = run_chaos(2000, seed=10, rss_trend=True)
    check(chaos, figures)
    check_rss_trend(figures)
