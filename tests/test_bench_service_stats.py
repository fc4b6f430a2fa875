"""The service benchmark's per-session figures (bench/service_session.py) from known arrival times."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from service_session import ChunkSeen, ObservedSession, case_summary, session_stats  # noqa: E402

FPS = 16


def record_with(arrivals_s: list[float], frames: list[int], start_sent: float = 0.0) -> ObservedSession:
    record = ObservedSession(label="s", pace=True, video={"fps": FPS}, start_sent=start_sent)
    pts = 0
    for index, (at, count) in enumerate(zip(arrivals_s, frames)):
        timings = {"queued_ms": 1.0, "denoise_ms": 100.0 + index, "decode_ms": 50.0, "encode_ms": 5.0,
                   "sent_at": at * 1000.0}
        record.chunks.append(ChunkSeen(index=index, pts=pts, frames=count, timings=timings, received=at,
                                       received_epoch_ms=at * 1000.0 + 2.0, segment_bytes=1024))
        pts += count
    return record


def test_a_session_on_time_has_no_misses_and_no_long_gaps():
    # 12-frame chunks (750 ms) arriving every 700 ms after the first at 0.2 s.
    stats = session_stats(record_with([0.2 + 0.7 * i for i in range(6)], [12] * 6))
    assert stats["time_to_first_media_ms"] == 200.0
    assert stats["chunk_duration_ms"] == 750.0
    assert stats["deadline_misses"] == 0 and stats["gaps_over_1_5x"] == 0
    assert stats["worst_gap_ms"] == 700.0
    assert stats["buffer_at_end_s"] == 4.5 - 3.5  # 72 frames received by 3.5 s after the first chunk
    assert stats["fps_steady"] == round(60 / 3.5, 2)
    assert stats["socket_latency_ms_median"] == 2.0
    assert stats["timeline_breaks"] == 0


def test_a_stall_counts_as_a_long_gap_and_makes_every_later_chunk_late():
    arrivals = [0.0, 0.7, 1.4, 3.6, 4.3]  # 2.2 s stall before chunk 3 (due at 2.25 s)
    stats = session_stats(record_with(arrivals, [12] * 5))
    assert stats["gaps_over_1_5x"] == 1
    assert stats["longest_gaps"] == [(2200.0, 3)]
    assert stats["deadline_misses"] == 2  # chunk 3 (1350 ms late) and chunk 4 (1300 ms late)
    assert stats["worst_late_ms"] == 1350.0
    assert stats["buffer_at_end_s"] == -0.55  # 60 frames (3.75 s) by 4.3 s: behind, the viewer waits


def test_a_short_opening_chunk_does_not_set_the_chunk_duration():
    # The protocol allows the first block as two chunks: 1 frame, then 8; then 12-frame blocks.
    frames = [1, 8, 12, 12, 12]
    arrivals = [0.0, 0.5, 1.2, 1.9, 2.6]
    stats = session_stats(record_with(arrivals, frames))
    assert stats["chunk_duration_ms"] == 750.0
    assert stats["gaps_over_1_5x"] == 0
    # The opening frame is a preview: playback starts with the block's rest (pts 1 at 500 ms, so frame 0 at
    # 437.5 ms); the still frame stayed 437.5 ms. Chunks 2-4 are then due at 1000 / 1750 / 2500 ms and came
    # 200 / 150 / 100 ms late.
    assert stats["opening_stall_ms"] == 437.5
    assert stats["deadline_misses"] == 3
    assert stats["worst_late_ms"] == 200.0


def test_the_rest_of_a_split_block_arriving_within_a_frame_makes_nothing_late():
    # Frame 0 at 100 ms, the block's rest 40 ms later (sooner than frame 0's 62.5 ms on screen): playback
    # starts with frame 0 itself, so nothing is late (the clock must not start before the first arrival).
    stats = session_stats(record_with([0.1, 0.14, 0.8, 1.5], [1, 11, 12, 12], start_sent=0.0))
    assert stats["opening_stall_ms"] == 0.0
    assert stats["deadline_misses"] == 0
    assert stats["worst_late_ms"] <= 0.0


def test_a_refused_session_reports_its_refusal_and_the_case_counts_it():
    served = session_stats(record_with([0.1, 0.8], [12, 12]))
    refused = session_stats(ObservedSession(label="r", pace=True, refusal={"reason": "capacity", "close_code": 1013}))
    assert refused["refused"]["close_code"] == 1013
    summary = case_summary([served, refused])
    assert summary["refused"] == 1 and summary["served"] == 1
    assert summary["fps_steady_sum"] == served["fps_steady"]


def test_the_client_sends_start_before_session_so_a_slow_stream_opening_counts_in_first_media():
    """Against a server that opens its stream only once `start` came (a slow opening, held ``HOLD_S``): the
    client must not wait for `session` first, and the hold must show in its time to first media."""
    import asyncio
    import json
    import time

    from websockets.asyncio.server import serve

    from service_session import run_session

    hold_s = 0.3
    first_messages = []

    async def server(ws):
        try:
            first_messages.append(json.loads(await asyncio.wait_for(ws.recv(), 5.0))["type"])
        except TimeoutError:
            return  # the client waited for `session`: it gets nothing
        await asyncio.sleep(hold_s)  # the stream's opening
        await ws.send(json.dumps({"type": "session", "session_id": "s", "state": "created", "video": {"fps": FPS}}))
        await ws.send(b"init")
        await ws.send(json.dumps({"type": "chunk", "index": 0, "pts": 0, "frames": 12, "timings": {}}))
        await ws.send(b"segment")
        async for message in ws:
            if json.loads(message)["type"] == "close":
                await ws.send(json.dumps({"type": "closed", "reason": "client"}))
                return

    async def scenario():
        async with serve(server, "127.0.0.1", 0) as listening:
            port = listening.sockets[0].getsockname()[1]
            return await run_session(f"ws://127.0.0.1:{port}", label="s", pace=False, seed=0, prompt="a fox",
                                     stop_at=time.monotonic() + hold_s + 0.5)

    record = asyncio.run(asyncio.wait_for(scenario(), 30))
    stats = session_stats(record)
    assert first_messages == ["start"]
    assert stats["chunks"] == 1 and stats["closed_reason"] == "client"
    assert stats["time_to_first_media_ms"] >= hold_s * 1000.0
    assert stats["connect_to_first_media_ms"] >= stats["time_to_first_media_ms"]
