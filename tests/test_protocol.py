"""Protocol v1 through FastAPI's TestClient against the real app and engine (tiny, 64x64, CPU).

Each test names the behaviour it proves and asserts on the messages, codes and values the client sees.
"""

from __future__ import annotations

import json
import time

import pytest
from starlette.websockets import WebSocketDisconnect

from app.settings import Settings
from app.transport.websocket import CLOSE_CODE_BY_REASON
from tests.conftest import decode_mp4
from tests.testclient_ws import hello, hello_and_init, next_chunk, next_control, start, until_closed

TOKEN = "test-token-0123456789abcdef"


# --- lifecycle and controls --------------------------------------------------------------------


def test_lifecycle_session_init_chunks_close(make_client):
    with make_client() as client, client.websocket_connect("/v1/stream") as ws:
        geometry = client.app.state.service.engine.geometry
        session = hello(ws)
        assert session["protocol"] == 1 and session["state"] == "created" and len(session["session_id"]) == 22
        assert session["video"]["width"] == 64 and session["video"]["height"] == 64 and session["video"]["fps"] == 16
        assert session["video"]["codec"].startswith("avc1.") and session["video"]["codec"] in session["mime"]
        if geometry.audio_sample_rate is None:
            assert session["audio"] is None
        else:
            audio = session["audio"]
            assert audio["sample_rate"] == geometry.audio_sample_rate and audio["channels"] == geometry.audio_channels
            assert audio["codec"] in ("opus", "mp4a.40.2") and audio["codec"] in session["mime"]
        start(ws, seed=7, options={"pace": False})

        chunks = [next_chunk(ws) for _ in range(3)]
        assert [c["index"] for c, _ in chunks] == [0, 1, 2]
        assert [c["pts"] for c, _ in chunks] == [0, 9, 21]  # the first block has 9 frames, then 12
        assert [c["frames"] for c, _ in chunks] == [9, 12, 12]
        for chunk, segment in chunks:
            timings = chunk["timings"]
            assert set(timings) == {"started_at", "queued_ms", "denoise_ms", "decode_ms", "encode_ms", "sent_at"}
            assert timings["denoise_ms"] > 0 and timings["decode_ms"] > 0 and timings["encode_ms"] > 0
            assert timings["sent_at"] >= timings["started_at"]
            assert segment[4:8] == b"moof"
        if geometry.audio_sample_rate is None:
            assert all(chunk["audio_samples"] == 0 for chunk, _ in chunks)
        else:  # after the first block (whose tail waits for the decoder's lookahead), audio keeps the video clock
            samples_per_frame = geometry.audio_sample_rate // 16
            assert 0 < chunks[0][0]["audio_samples"] <= chunks[0][0]["frames"] * samples_per_frame
            later = [chunk for chunk, _ in chunks[1:]]
            assert [c["audio_samples"] for c in later] == [c["frames"] * samples_per_frame for c in later]

        ws.send_json({"type": "close", "id": "bye"})
        texts, code = until_closed(ws)
        assert {"type": "ack", "id": "bye", "of": "close"} in texts
        assert texts[-1] == {"type": "closed", "reason": "client"} and code == 1000
        detail = client.get(f"/v1/sessions/{session['session_id']}").json()
        assert detail["state"] == "closed" and detail["close_reason"] == "client"


def test_every_control_message_is_acked_with_state_changes(make_client):
    with make_client() as client, client.websocket_connect("/v1/stream") as ws:
        hello(ws)
        start(ws, seed=3)
        next_chunk(ws)
        for policy in ("soft", "recache", "reset"):
            ws.send_json({"type": "prompt", "prompt": f"policy {policy}", "policy": policy, "id": policy})
            assert next_control(ws) == {"type": "ack", "id": policy, "of": "prompt"}
        ws.send_json({"type": "prompt", "prompt": "default policy"})  # no id: ack carries id null
        assert next_control(ws) == {"type": "ack", "id": None, "of": "prompt"}
        ws.send_json({"type": "pause", "id": "p"})
        assert next_control(ws) == {"type": "ack", "id": "p", "of": "pause"}
        assert next_control(ws) == {"type": "state", "state": "paused"}
        ws.send_json({"type": "pause", "id": "p2"})  # already paused: acked, no state change
        ws.send_json({"type": "resume", "id": "r"})
        assert next_control(ws) == {"type": "ack", "id": "p2", "of": "pause"}
        assert next_control(ws) == {"type": "ack", "id": "r", "of": "resume"}
        assert next_control(ws) == {"type": "state", "state": "active"}
        ws.send_json({"type": "reset", "id": "z"})
        assert next_control(ws) == {"type": "ack", "id": "z", "of": "reset"}
        chunk, _ = next_chunk(ws)
        while "z" not in chunk.get("controls", ()):  # the first frames of the restarted content name the reset
            chunk, _ = next_chunk(ws)
        assert chunk["frames"] == 1  # a first block again: its opening latent frame decodes to one frame
        assert chunk["index"] > 0  # ... while the chunk index continues


def test_every_error_code_leaves_the_socket_open(make_client):
    with make_client() as client, client.websocket_connect("/v1/stream") as ws:
        hello(ws)

        def error_for(payload) -> dict:
            ws.send_text(payload if isinstance(payload, str) else json.dumps(payload))
            reply = next_control(ws)
            assert reply["type"] == "error", reply
            return reply

        assert error_for("{not json")["code"] == "bad_json"
        assert error_for("[1, 2]")["code"] == "bad_json"
        ws.send_bytes(b"\x00\x01")
        assert next_control(ws)["code"] == "bad_json"
        unknown = error_for({"type": "dance", "id": "d"})
        assert unknown["code"] == "unknown_type" and unknown["id"] == "d"
        assert error_for({"prompt": "no type"})["code"] == "unknown_type"
        extra = error_for({"type": "pause", "id": "x", "volume": 11})
        assert extra["code"] == "invalid_field" and extra["id"] == "x" and "volume" in extra["message"]
        assert error_for({"type": "start", "prompt": "p", "seed": -1})["code"] == "invalid_field"
        assert error_for({"type": "start", "prompt": "p", "seed": True})["code"] == "invalid_field"
        assert error_for({"type": "start", "prompt": ""})["code"] == "invalid_field"
        assert error_for({"type": "start", "prompt": "p", "options": {"guidance": 99}})["code"] == "invalid_field"
        assert error_for({"type": "start", "prompt": "p", "options": {"guidance": 4.0}})["code"] == "invalid_field"
        assert error_for({"type": "prompt", "prompt": "p", "policy": "sideways"})["code"] == "invalid_field"
        long_id = error_for({"type": "pause", "id": "i" * 65})
        assert long_id["code"] == "invalid_field" and "id" not in long_id  # an id over 64 is not echoed
        too_long = error_for({"type": "start", "prompt": "x" * 2001, "id": "long"})
        assert too_long["code"] == "prompt_too_long" and too_long["id"] == "long"
        assert "xxxx" not in too_long["message"]  # the input is never echoed
        for kind in ("pause", "resume", "reset"):
            refused = error_for({"type": kind, "id": kind})
            assert refused["code"] == "not_started" and refused["id"] == kind
        assert error_for({"type": "prompt", "prompt": "early"})["code"] == "not_started"

        start(ws)
        again = error_for({"type": "start", "prompt": "again", "id": "again"})
        assert again["code"] == "already_started" and again["id"] == "again"
        next_chunk(ws)  # still streaming after all of that
    metrics = client.get("/metrics").text
    assert 'arstream_errors_total{code="prompt_too_long"} 1.0' in metrics


def test_rate_limited_messages_are_refused_not_applied(make_client):
    with make_client(control_rate_per_s=0.5, control_burst=3) as client, client.websocket_connect("/v1/stream") as ws:
        hello(ws)
        for n in range(5):
            ws.send_json({"type": "pause", "id": f"m{n}"})
        replies = [next_control(ws) for _ in range(5)]
        assert [r["code"] for r in replies] == ["not_started"] * 3 + ["rate_limited"] * 2
        assert [r["id"] for r in replies] == ["m0", "m1", "m2", "m3", "m4"]
        ws.send_json({"type": "start", "prompt": "refused start", "id": "s"})
        assert next_control(ws) == {
            "type": "error", "code": "rate_limited", "id": "s", "message": replies[-1]["message"],
        }
        session_id = client.get("/v1/sessions").json()["sessions"][0]["session_id"]
        assert client.get(f"/v1/sessions/{session_id}").json()["state"] == "created"  # not applied


def test_session_closed_when_attaching_to_an_ended_session(make_client):
    with make_client() as client:
        with client.websocket_connect("/v1/stream") as ws:
            session_id = hello(ws)["session_id"]
            ws.send_json({"type": "close"})
            _, code = until_closed(ws)
            assert code == 1000
        with client.websocket_connect(f"/v1/sessions/{session_id}/stream") as ws:
            texts, code = until_closed(ws)
        assert texts[0]["type"] == "error" and texts[0]["code"] == "session_closed"
        assert texts[1] == {"type": "closed", "reason": "client"} and code == 1000


def test_unknown_session_closes_4404(make_client):
    with make_client() as client:
        with client.websocket_connect("/v1/sessions/AAAAAAAAAAAAAAAAAAAAAA/stream") as ws:
            with pytest.raises(WebSocketDisconnect) as closed:
                ws.receive_text()
        assert closed.value.code == 4404


def test_second_socket_replaces_the_first(make_client):
    with make_client() as client, client.websocket_connect("/v1/stream") as first:
        session_id = hello(first)["session_id"]
        start(first, options={"pace": False})
        last_index = next_chunk(first)[0]["index"]
        with client.websocket_connect(f"/v1/sessions/{session_id}/stream") as second:
            texts, code = until_closed(first)
            assert texts[-1] == {"type": "closed", "reason": "replaced"} and code == 1000
            seen = [t for t in texts if t["type"] == "chunk"]
            last_index = seen[-1]["index"] if seen else last_index
            session, init = hello_and_init(second)
            assert session["session_id"] == session_id and session["state"] == "active"
            chunk, segment = next_chunk(second)
            assert chunk["index"] > last_index
            # The new socket's timeline starts at its first chunk's pts.
            frames, times = decode_mp4(init + segment)
            assert frames.shape[0] == chunk["frames"] and times[0] == pytest.approx(chunk["pts"] / 16)
        assert client.get(f"/v1/sessions/{session_id}").json()["state"] == "detached"  # it outlived both sockets


def test_capacity_refusal_on_socket_and_rest(make_client):
    with make_client(engine={"max_sessions": 1}) as client, client.websocket_connect("/v1/stream") as holder:
        hello(holder)
        start(holder)
        with client.websocket_connect("/v1/stream") as refused:
            texts, code = until_closed(refused)
        assert [t["type"] for t in texts] == ["closed"] and texts[0]["reason"] == "capacity" and code == 1013
        assert texts[0]["retry_after_s"] >= 1  # when to try again
        response = client.post("/v1/sessions")
        assert response.status_code == 503 and response.json()["error"]["code"] == "capacity"
        assert int(response.headers["Retry-After"]) >= 1


def test_detached_session_is_evicted_for_a_newcomer_and_says_so_on_reconnect(make_client):
    with make_client(engine={"max_sessions": 1}) as client:
        with client.websocket_connect("/v1/stream") as first:
            evicted_id = hello(first)["session_id"]
            start(first)
        assert client.get(f"/v1/sessions/{evicted_id}").json()["state"] == "detached"
        with client.websocket_connect("/v1/stream") as newcomer:  # the only slot: the detached one goes
            hello(newcomer)
            start(newcomer)
            detail = client.get(f"/v1/sessions/{evicted_id}").json()
            assert detail["state"] == "closed" and detail["close_reason"] == "evicted"
            with client.websocket_connect(f"/v1/sessions/{evicted_id}/stream") as late:
                texts, code = until_closed(late)
            assert texts[0]["code"] == "session_closed" and texts[1] == {"type": "closed", "reason": "evicted"}
            next_chunk(newcomer)  # the newcomer streams on


def test_idle_created_session_is_closed_with_idle_timeout(make_client):
    with make_client(engine={"idle_timeout_s": 0.3}) as client, client.websocket_connect("/v1/stream") as ws:
        hello(ws)
        texts, code = until_closed(ws)  # never started
        assert texts == [{"type": "closed", "reason": "idle_timeout"}] and code == 1000


def test_too_many_sessions_for_one_client(make_client):
    with make_client(max_sessions_per_client=1) as client:
        assert client.post("/v1/sessions").status_code == 201
        response = client.post("/v1/sessions")
        assert response.status_code == 429 and response.json()["error"]["code"] == "rate_limited"
        assert "Retry-After" in response.headers


# --- access --------------------------------------------------------------------------------------


def test_foreign_origin_is_refused_1008_before_accept(make_client):
    with make_client() as client:
        for origin in ("http://evil.example", "null", "http://testserver.evil.example"):
            with pytest.raises(WebSocketDisconnect) as refused:
                with client.websocket_connect("/v1/stream", headers={"Origin": origin}):
                    pass
            assert refused.value.code == 1008
        for origin in ("http://testserver", "http://localhost:5173", "http://127.0.0.1:9"):
            with client.websocket_connect("/v1/stream", headers={"Origin": origin}) as ws:
                hello(ws)
        assert client.post("/v1/sessions", headers={"Origin": "http://evil.example"}).status_code == 403
    with make_client(allowed_origins=["https://studio.example"]) as client:
        with client.websocket_connect("/v1/stream", headers={"Origin": "https://studio.example"}) as ws:
            hello(ws)


def test_token_auth_by_header_or_subprotocol(make_client):
    with make_client(token=TOKEN) as client:
        for kwargs in ({}, {"headers": {"Authorization": "Bearer wrong"}}, {"subprotocols": ["arstream.v1"]}):
            with pytest.raises(WebSocketDisconnect) as refused:
                with client.websocket_connect("/v1/stream", **kwargs):
                    pass
            assert refused.value.code == 1008
        with client.websocket_connect("/v1/stream", headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
            hello(ws)
        with client.websocket_connect("/v1/stream", subprotocols=["arstream.v1", f"bearer.{TOKEN}"]) as ws:
            assert ws.accepted_subprotocol == "arstream.v1"
            hello(ws)

        assert client.post("/v1/sessions").status_code == 401
        assert client.get("/v1/sessions").json()["error"]["code"] == "unauthorized"
        authorized = {"Authorization": f"Bearer {TOKEN}"}
        created = client.post("/v1/sessions", headers=authorized)
        assert created.status_code == 201
        listed = client.get("/v1/sessions", headers=authorized).json()["sessions"]
        assert created.json()["session_id"] in [s["session_id"] for s in listed]
        assert client.get("/healthz").status_code == 200  # probes need no token


def test_message_over_the_limit_closes_1009(make_client):
    with make_client(max_message_bytes=4096) as client, client.websocket_connect("/v1/stream") as ws:
        session_id = hello(ws)["session_id"]
        ws.send_json({"type": "start", "prompt": "p" * 1000})  # under the limit: fine
        assert next_control(ws)["type"] == "ack"
        ws.send_text(json.dumps({"type": "prompt", "prompt": "é" * 2048}))  # 2048 chars, 4 KiB + JSON
        _, code = until_closed(ws)
        assert code == 1009
        assert client.get(f"/v1/sessions/{session_id}").json()["state"] == "detached"  # reconnectable


def test_production_settings_refuse_unsafe_defaults():
    with pytest.raises(ValueError, match="ARSTREAM_TOKEN"):
        Settings(environment="production")
    with pytest.raises(ValueError, match="at least 16"):
        Settings(environment="production", token="short")
    with pytest.raises(ValueError, match="origin"):
        Settings(environment="production", token=TOKEN, allowed_origins=["*"])
    assert Settings(environment="production", allow_no_token=True).token is None
    assert Settings(environment="production", token=TOKEN, allowed_origins=["*"], allow_wildcard_origin=True)
    with pytest.raises(ValueError, match="URL-safe"):
        Settings(token="has space")


def test_settings_read_nested_environment(monkeypatch):
    monkeypatch.setenv("ARSTREAM_ENGINE__HEIGHT", "96")
    monkeypatch.setenv("ARSTREAM_PORT", "9001")
    settings = Settings(engine={"width": 128})
    assert (settings.engine.height, settings.engine.width, settings.port) == (96, 128, 9001)


# --- REST parity ---------------------------------------------------------------------------------


def test_rest_create_controls_and_delete_reach_the_socket(make_client):
    secret_prompt = "a lighthouse at dusk, secret words"
    with make_client() as client:
        created = client.post("/v1/sessions", json={"prompt": secret_prompt, "seed": 5, "options": {"pace": True}})
        assert created.status_code == 201
        body = created.json()
        session_id = body["session_id"]
        assert body["state"] == "created"
        assert body["stream_url"] == f"ws://testserver/v1/sessions/{session_id}/stream"
        assert client.post(f"/v1/sessions/{session_id}/pause").json()["error"]["code"] == "not_started"

        with client.websocket_connect(f"/v1/sessions/{session_id}/stream") as ws:
            assert hello(ws)["state"] == "active"  # the prompt in the body started it on attach
            next_chunk(ws)
            paused = client.post(f"/v1/sessions/{session_id}/pause")
            assert paused.status_code == 200 and paused.json() == {"session_id": session_id, "state": "paused"}
            assert next_control(ws) == {"type": "state", "state": "paused"}
            assert client.post(f"/v1/sessions/{session_id}/resume").json()["state"] == "active"
            assert next_control(ws) == {"type": "state", "state": "active"}
            changed = client.post(f"/v1/sessions/{session_id}/prompt", json={"prompt": "new", "policy": "recache"})
            assert changed.status_code == 200
            assert client.post(f"/v1/sessions/{session_id}/reset").status_code == 200

            detail = client.get(f"/v1/sessions/{session_id}")
            assert secret_prompt not in detail.text and "prompt\"" not in detail.text.replace("prompt_length", "")
            info = detail.json()
            assert info["prompt_length"] == 3 and info["seed"] == 5 and info["attached"] is True
            assert info["counters"]["chunks"] >= 1 and info["time_to_first_chunk_ms"] > 0
            assert info["last_timings"]["denoise_ms"] > 0
            listed = client.get("/v1/sessions").json()["sessions"]
            assert {"session_id": session_id, "state": "active"} in listed

            assert client.delete(f"/v1/sessions/{session_id}").status_code == 204
            texts, code = until_closed(ws)
            assert texts[-1] == {"type": "closed", "reason": "client"} and code == 1000
        assert client.get(f"/v1/sessions/{session_id}").status_code == 404


def test_rest_errors_share_one_shape(make_client):
    with make_client(max_message_bytes=4096) as client:
        session_id = client.post("/v1/sessions").json()["session_id"]

        def error(response, status):
            assert response.status_code == status, response.text
            body = response.json()
            assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}
            return body["error"]["code"]

        assert error(client.get("/v1/sessions/nope"), 404) == "unknown_session"
        assert error(client.post("/v1/sessions", json={"seed": -3}), 400) == "invalid_field"
        assert error(client.post("/v1/sessions", json={"color": "red"}), 400) == "invalid_field"
        assert error(client.post("/v1/sessions", content=b"{nope", headers={"Content-Type": "application/json"}),
                     400) == "bad_json"
        assert error(client.post("/v1/sessions", json={"prompt": "x" * 2001}), 413) == "prompt_too_long"
        assert error(client.post("/v1/sessions", json={"prompt": "x" * 5000}), 413) == "invalid_field"  # body cap
        assert error(client.post(f"/v1/sessions/{session_id}/prompt", json={"prompt": "p"}), 409) == "not_started"
        assert error(client.post(f"/v1/sessions/{session_id}/prompt", json={"prompt": "p", "policy": "x"}),
                     400) == "invalid_field"
        assert error(client.get("/no/such/route"), 404) == "not_found"


def test_rest_session_closed_is_409_while_the_record_is_kept(make_client):
    with make_client(engine={"idle_timeout_s": 0.3}) as client:
        session_id = client.post("/v1/sessions").json()["session_id"]
        for _ in range(100):
            detail = client.get(f"/v1/sessions/{session_id}").json()
            if detail["state"] == "closed":
                break
            time.sleep(0.05)
        assert detail["close_reason"] == "idle_timeout"
        response = client.post(f"/v1/sessions/{session_id}/reset")
        assert response.status_code == 409 and response.json()["error"]["code"] == "session_closed"


# --- health, metrics, drain, dead engine ----------------------------------------------------------


def test_health_readiness_metrics_and_docs(make_client):
    with make_client() as client:
        assert client.get("/healthz").json() == {"status": "ok", "detail": None}
        assert client.get("/readyz").status_code == 200
        with client.websocket_connect("/v1/stream") as ws:
            hello(ws)
            start(ws, options={"pace": False})
            next_chunk(ws)
            next_chunk(ws)
            metrics = client.get("/metrics")
        assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
        text = metrics.text
        for family in (
            "arstream_sessions{", "arstream_engine_ticks_total", "arstream_engine_blocks_total",
            "arstream_kv_blocks_in_use", "arstream_kv_blocks_total", "arstream_queue_depth_total",
            "arstream_frames_per_second", 'arstream_chunk_latency_seconds_bucket{le="+Inf"}',
            "arstream_time_to_first_chunk_seconds_count 1", "arstream_encode_seconds_count",
        ):
            assert family in text, family
        samples = dict(line.split() for line in text.splitlines() if line and not line.startswith("#"))
        chunks_sent = float(samples["arstream_chunks_sent_total"])
        assert chunks_sent >= 2
        assert client.get("/docs").status_code == 200
        paths = client.get("/openapi.json").json()["paths"]
        assert "/v1/sessions" in paths and "/v1/sessions/{session_id}/prompt" in paths


def test_drain_tells_every_client_then_refuses(make_client):
    with make_client() as client:
        service = client.app.state.service
        with client.websocket_connect("/v1/stream") as ws:
            hello(ws)
            start(ws)
            client.portal.start_task_soon(service.drain)
            texts, code = until_closed(ws)
        drain_s = service.settings.drain_timeout_s
        assert texts[-1] == {"type": "closed", "reason": "draining", "retry_after_s": drain_s} and code == 1001
        assert client.get("/readyz").status_code == 503
        with client.websocket_connect("/v1/stream") as late:
            texts, code = until_closed(late)
        assert texts == [{"type": "closed", "reason": "draining", "retry_after_s": drain_s}] and code == 1001
        response = client.post("/v1/sessions")
        assert response.status_code == 503 and "Retry-After" in response.headers


def test_dead_engine_fails_sessions_and_asks_the_process_to_exit(make_client):
    exits = []
    with make_client() as client:
        client.app.state.on_engine_dead = lambda: exits.append(True)
        service = client.app.state.service
        def device_fatal(*args, **kwargs):
            raise RuntimeError("CUDA error: simulated")

        # The engine's own path for a device-fatal error in a step.
        service.engine.runner.pipeline.forward_branch = device_fatal
        with client.websocket_connect("/v1/stream") as ws:
            hello(ws)
            start(ws)
            texts, code = until_closed(ws)
        assert texts[-2]["type"] == "error" and texts[-2]["code"] == "internal"
        assert "CUDA" not in texts[-2]["message"]  # no internals leak to clients
        assert texts[-1] == {"type": "closed", "reason": "failed"} and code == CLOSE_CODE_BY_REASON["failed"] == 1011
        assert client.get("/readyz").status_code == 503
        for _ in range(100):
            if exits:
                break
            time.sleep(0.02)
        assert exits == [True] and service.exit_code == 1


def test_histogram_exposition_is_cumulative_with_inclusive_bounds():
    from app.telemetry import ENCODE_BUCKETS_S, ServiceMetrics
    from engine.api import EngineCounters

    metrics = ServiceMetrics()
    for value in (0.0005, 0.001, 0.002, 5.0):  # the first bound is 0.001: inclusive
        metrics.encode.observe(value)
    counters = EngineCounters(
        ready=True, alive=True, draining=False, ticks=0, blocks=0, capacity=1, live_capacity=None,
        realtime_admission=True, block_cost_ms=None, realtime_utilisation=0.0, sessions_by_state={},
        live_sessions=0, live_sessions_below_realtime=0, deadline_misses=0, refused_realtime=0, kv_blocks_total=0,
        kv_blocks_in_use=0, decoder_state_bytes=0, queue_depths=(), session_frames_per_second=(),
        session_deadline_misses=(),
    )
    lines = metrics.render(counters).decode().splitlines()
    assert "# TYPE arstream_encode_seconds histogram" in lines
    assert ENCODE_BUCKETS_S[:2] == (0.001, 0.0025)
    assert 'arstream_encode_seconds_bucket{le="0.001"} 2.0' in lines
    assert 'arstream_encode_seconds_bucket{le="0.0025"} 3.0' in lines
    assert 'arstream_encode_seconds_bucket{le="1.0"} 3.0' in lines
    assert 'arstream_encode_seconds_bucket{le="+Inf"} 4.0' in lines
    assert "arstream_encode_seconds_count 4.0" in lines
    total = next(line for line in lines if line.startswith("arstream_encode_seconds_sum "))
    assert float(total.split()[1]) == pytest.approx(5.0035)


def test_health_answers_and_readiness_is_503_while_the_engine_warms_up():
    from fastapi.testclient import TestClient

    from app.main import create_app
    from tests.conftest import small_engine, wait_ready

    # The full tiny size: the engine needs seconds before it is ready. Warming up is the build (in the background,
    # seconds of it alone at this size) and then the warm-up blocks (two here; one by default).
    settings = Settings(engine=small_engine(height=144, width=256, warmup_blocks=2))
    with TestClient(create_app(settings)) as client:
        assert client.get("/healthz").status_code == 200
        warming = client.get("/readyz")
        assert warming.status_code == 503 and "warming" in warming.text
        assert client.post("/v1/sessions").status_code == 503
        with client.websocket_connect("/v1/stream") as ws:
            error = json.loads(ws.receive_text())
            assert error["type"] == "error" and "warming" in error["message"]
            assert json.loads(ws.receive_text()) == {"type": "closed", "reason": "capacity", "retry_after_s": 5.0}
            with pytest.raises(WebSocketDisconnect) as closed:
                ws.receive_text()
            assert closed.value.code == 1013
        wait_ready(client.get)
        assert client.post("/v1/sessions").status_code == 201


def test_refused_inputs_leave_a_log_line_and_a_bad_pace_query_is_refused(make_client, caplog):
    """An operator sees what was refused: one log line per refused client input (bounded: a flood logs a few
    a second and says how many it left out), socket and REST alike. A socket asks for best effort at connect
    with `?pace=false`; any other value is refused with `invalid_field` before a session is made."""
    import logging

    with caplog.at_level(logging.INFO, logger="arstream.refused"):
        with make_client() as client:
            with client.websocket_connect("/v1/stream") as ws:
                hello(ws)
                ws.send_text("not json")
                assert next_control(ws)["code"] == "bad_json"
            assert client.post("/v1/sessions", json={"unknown": 1}).status_code == 400
            before = client.get("/v1/sessions").json()["sessions"]
            with client.websocket_connect("/v1/stream?pace=maybe") as ws:
                error = ws.receive_json()
                assert error["type"] == "error" and error["code"] == "invalid_field"
                with pytest.raises(WebSocketDisconnect) as closed:
                    ws.receive_json()
                assert closed.value.code == 1008
            assert client.get("/v1/sessions").json()["sessions"] == before  # nothing was made for it
            with client.websocket_connect("/v1/stream?pace=false") as ws:
                hello(ws)
                start(ws, seed=1)
                next_chunk(ws)
    refused = [(r.via, r.code) for r in caplog.records if r.name == "arstream.refused"]
    assert ("socket", "bad_json") in refused and ("rest", "invalid_field") in refused
    assert ("socket", "invalid_field") in refused
