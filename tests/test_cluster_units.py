"""The scale-out's parts on their own: placement order, the session table's bounds, the worker's capacity
route and its guard, the `--devices` flag and what a front end passes on to its workers.

The processes themselves (a front end and two workers) are tested in tests/test_scale_out.py.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from app.cli import build_parser, parse_devices, worker_argv
from app.cluster.local_pool import worker_names
from app.cluster.placement import WorkerLoad, placement_order
from app.cluster.table import SessionTable
from app.main import create_app
from app.security import INTERNAL_HEADER
from app.settings import Settings
from app.transport.refusal import UNAVAILABLE_RETRY_AFTER_S, Refusal, every_worker_refused, worker_full
from tests.conftest import small_engine, wait_ready


def load(name: str, *, ready=True, admitting=True, slots_free=2, live_headroom=None, open_sessions=0,
         utilisation=0.0, generation=1) -> WorkerLoad:
    return WorkerLoad(name, generation, ready=ready, admitting=admitting, live_sessions=open_sessions,
                      live_headroom=live_headroom, slots_free=slots_free, utilisation=utilisation,
                      open_sessions=open_sessions)


# --- placement -----------------------------------------------------------------------------------------


def test_placement_prefers_the_most_headroom_then_the_fewest_sessions():
    loads = [
        load("cuda:0", slots_free=1, open_sessions=3),
        load("cuda:1", slots_free=3, open_sessions=1),
        load("cuda:2", slots_free=3, open_sessions=0),
        load("cuda:3", slots_free=3, open_sessions=0, utilisation=0.4),
    ]
    assert [w.name for w in placement_order(loads)] == ["cuda:2", "cuda:3", "cuda:1", "cuda:0"]


def test_realtime_room_bounds_headroom_once_measured():
    # 4 free slots but time for only 1 more live session, against 2 slots with time for 2.
    slots_rich = load("cuda:0", slots_free=4, live_headroom=1)
    time_rich = load("cuda:1", slots_free=2, live_headroom=2)
    assert slots_rich.headroom == 1 and time_rich.headroom == 2
    assert [w.name for w in placement_order([slots_rich, time_rich])] == ["cuda:1", "cuda:0"]
    assert load("cuda:2", slots_free=3, live_headroom=None).headroom == 3  # nothing measured: slots decide


def test_workers_that_would_refuse_come_last_and_unready_ones_never():
    loads = [
        load("cuda:0", admitting=False, slots_free=0, open_sessions=4),
        load("cuda:1", ready=False, admitting=False),
        load("cuda:2", slots_free=0, open_sessions=4),  # admits by evicting an idle session
    ]
    assert [w.name for w in placement_order(loads)] == ["cuda:2", "cuda:0"]
    assert placement_order([load("cuda:1", ready=False)]) == []


def test_a_placement_counts_against_its_worker_until_the_next_answer():
    a, b = load("cpu-0", slots_free=2), load("cpu-1", slots_free=2)
    first = placement_order([a, b])[0]
    assert first.name == "cpu-0"
    after = first.after_placement()
    assert (after.slots_free, after.open_sessions, after.admitting) == (1, 1, True)
    assert placement_order([after, b])[0].name == "cpu-1"  # the next one goes to the other worker
    full = after.after_placement()
    assert (full.slots_free, full.headroom, full.admitting) == (0, 0, False)
    timed = load("cpu-0", slots_free=3, live_headroom=1).after_placement()
    assert (timed.live_headroom, timed.admitting) == (0, False)


def test_capacity_answers_are_read_defensively():
    parsed = WorkerLoad.from_answer("ray-gpu-0", 7, {
        "ready": True, "admitting": True, "live_sessions": 2, "live_headroom": None, "slots_free": 1,
        "utilisation": 0.5, "device": "cuda:0", "generation": 7,
    })  # the shared interface's fields only: no open_sessions, no retry_after_s
    assert (parsed.open_sessions, parsed.retry_after_s, parsed.headroom) == (2, None, 1)
    junk = WorkerLoad.from_answer("w", 1, {"ready": "yes", "live_sessions": -3, "slots_free": True,
                                           "utilisation": float("nan")})
    assert (junk.ready, junk.admitting, junk.live_sessions, junk.slots_free, junk.utilisation) == (
        False, False, 0, 0, 0.0)


def test_a_refusal_of_every_worker_retries_at_the_soonest():
    def soonest(*retries):
        return every_worker_refused([worker_full(retry_after_s=r) for r in retries]).retry_after_s

    assert (soonest(12.0, None, 3.5), soonest(0.2), soonest(None, None)) == (3.5, 1.0, UNAVAILABLE_RETRY_AFTER_S)
    # REST answers with what that worker said (its code and message) and the soonest time; a socket hears `closed`.
    said = every_worker_refused([worker_full("capacity", "full", 12.0), worker_full("unavailable", "warming", 5.0)])
    assert said == Refusal("capacity", "unavailable", "warming", 5.0)


# --- the session table -----------------------------------------------------------------------------------


def test_the_table_is_bounded_and_never_drops_an_open_session_to_make_room():
    table = SessionTable(max_entries=3, closed_retention_s=30)
    for index in range(3):
        assert table.reserve()
        table.add(f"s{index}", "cpu-0", 1, "10.0.0.1", now=float(index))
    assert not table.reserve(), "a full table of open sessions must refuse the next one"
    assert len(table) == 3 and all(table.lookup(f"s{i}") for i in range(3))
    table.ended("s1", now=10.0)
    table.ended("s0", now=11.0)
    assert table.reserve(), "an ended entry makes room"
    assert table.lookup("s1") is None and table.lookup("s0") is not None  # the oldest ended one went
    table.add("s3", "cpu-1", 1, "10.0.0.2", now=12.0)
    assert table.reserve() and table.lookup("s0") is None  # the last ended one
    table.add("s4", "cpu-1", 1, "10.0.0.2", now=13.0)
    assert not table.reserve()
    table.cancel()  # a cancel without a reservation changes nothing
    assert not table.reserve()
    assert sorted(table.sessions_by_worker().items()) == [("cpu-0", 1), ("cpu-1", 2)]


def test_reservations_count_against_the_bound_until_added_or_cancelled():
    table = SessionTable(max_entries=2, closed_retention_s=30)
    assert table.reserve() and table.reserve()
    assert not table.reserve()
    table.cancel()
    assert table.reserve()


def test_the_table_forgets_ended_sessions_after_retention_and_a_lost_workers_at_once():
    table = SessionTable(max_entries=10, closed_retention_s=30)
    for session_id, worker, generation in (("a", "cuda:0", 1), ("b", "cuda:0", 1), ("c", "cuda:1", 1)):
        table.reserve()
        table.add(session_id, worker, generation, "10.0.0.1", now=0.0)
    table.ended("c", now=5.0)
    table.sweep(now=34.0)
    assert table.lookup("c") is not None
    table.sweep(now=35.0)
    assert table.lookup("c") is None
    assert sorted(table.forget_worker("cuda:0", 1)) == ["a", "b"]
    assert len(table) == 0
    for session_id, worker, generation in (("d", "cuda:0", 2), ("e", "cuda:1", 1), ("f", "cuda:2", 1)):
        table.reserve()
        table.add(session_id, worker, generation, "10.0.0.1", now=40.0)
    table.retain_generations({"cuda:0": 2, "cuda:1": 2})  # cuda:1 was replaced, cuda:2 is restarting
    assert [table.lookup(i) is not None for i in "def"] == [True, False, False]


def test_reconcile_forgets_what_the_worker_forgot_but_not_what_was_just_placed():
    table = SessionTable(max_entries=10, closed_retention_s=30)
    for session_id, added_at in (("old", 1.0), ("closed", 1.0), ("kept", 1.0), ("new", 9.0)):
        table.reserve()
        table.add(session_id, "cuda:0", 2, "10.0.0.1", now=added_at)
    table.reserve()
    table.add("other-generation", "cuda:0", 1, "10.0.0.1", now=1.0)
    table.reconcile("cuda:0", 2, {"closed": "closed", "kept": "active"}, listed_since=5.0, now=6.0)
    assert table.lookup("old") is None
    assert table.lookup("closed").ended_at == 6.0
    assert table.lookup("kept").ended_at is None
    assert table.lookup("new") is not None, "placed after the list was asked for"
    assert table.lookup("other-generation") is not None
    assert table.open_sessions_of("10.0.0.1") == 3  # kept, new, other-generation
    assert table.sessions_by_worker() == {"cuda:0": 3}


# --- the worker side ----------------------------------------------------------------------------------


def test_a_single_server_has_no_internal_routes(make_client):
    with make_client() as client:
        assert client.get("/internal/capacity").status_code == 404


def test_a_worker_answers_only_its_front_end_and_reports_its_admission():
    secret = "front-end-secret"
    settings = Settings(engine=small_engine(max_sessions=1),
                        worker={"name": "cpu-1", "generation": 3, "secret": secret})
    ours = {INTERNAL_HEADER: secret}
    with TestClient(create_app(settings)) as client:
        wait_ready(lambda path: client.get(path, headers=ours))
        for path in ("/internal/capacity", "/healthz", "/v1/sessions"):
            assert client.get(path).status_code == 403
            assert client.get(path, headers={INTERNAL_HEADER: "guess"}).status_code == 403
        with pytest.raises(WebSocketDisconnect) as refused:
            with client.websocket_connect("/v1/stream"):
                pass
        assert refused.value.code == 1008

        capacity = client.get("/internal/capacity", headers=ours).json()
        assert capacity == {
            "ready": True, "admitting": True, "live_sessions": 0, "live_headroom": None, "slots_free": 1,
            "utilisation": 0.0, "device": "cpu", "generation": 3, "name": "cpu-1", "open_sessions": 0,
            "retry_after_s": capacity["retry_after_s"],
        }
        created = client.post("/v1/sessions", json={}, headers=ours)
        assert created.status_code == 201
        full = client.get("/internal/capacity", headers=ours).json()
        assert (full["admitting"], full["slots_free"], full["open_sessions"], full["live_sessions"]) == (False, 0, 1, 1)
        assert full["retry_after_s"] >= 1
        refused_rest = client.post("/v1/sessions", json={}, headers=ours)
        assert refused_rest.status_code == 503  # what the capacity answer predicted
        paused = client.post(f"/v1/sessions/{created.json()['session_id']}/pause", headers=ours)
        assert paused.status_code == 409  # not started: a created session is not evictable either
        client.delete(f"/v1/sessions/{created.json()['session_id']}", headers=ours)
        assert client.get("/internal/capacity", headers=ours).json()["admitting"] is True


# --- the command line -----------------------------------------------------------------------------------


def test_devices_are_parsed_strictly():
    assert parse_devices("cpu,cpu") == ["cpu", "cpu"]
    assert parse_devices(" cpu ") == ["cpu"]
    for value, phrase in (("all", "CPU-only"), ("cuda:0,cuda:0", "named twice"), ("gpu0", "not a device"),
                          ("", "comma-separated"), ("cpu,,cpu", "comma-separated"), ("cpu,cuda:0", "mixed"),
                          ("cuda:1", "CPU-only"), (",".join(["cpu"] * 65), "at most")):
        with pytest.raises(ValueError, match=phrase):
            parse_devices(value)
    assert worker_names(["cpu", "cpu"]) == ["cpu-0", "cpu-1"]
    assert worker_names(["cuda:0", "cuda:3"]) == ["cuda:0", "cuda:3"]


def test_workers_get_every_serve_flag_but_the_front_ends_own():
    argv = ["serve", "--devices", "cpu,cpu", "--host", "0.0.0.0", "--port", "9000", "--max-sessions-per-client", "2",
            "--log-format", "text", "--preset", "tiny", "--random-weights", "--no-audio", "--height", "64",
            "--width", "96", "--max-sessions", "1", "--warmup-blocks", "0", "--detach-grace-s", "2.5",
            "--allowed-origin", "https://a.example", "--allowed-origin", "https://b.example", "--cpu-threads", "1",
            "--guidance", "1.5", "--environment", "development", "--lead-chunks", "3", "--sink-frames", "1",
            "--window-frames", "3", "--dtype", "float32"]
    args = build_parser().parse_args(argv)
    passed = worker_argv(args)
    for own in ("--devices", "--host", "--port", "--max-sessions-per-client", "--log-format", "--device"):
        assert own not in passed
    again = vars(build_parser().parse_args(["serve", *passed]))
    expected = {k: v for k, v in vars(args).items()
                if k not in ("devices", "host", "port", "max_sessions_per_client", "log_format")}
    assert again == expected
