"""Hostile input against a real `arstream serve`: every bad message is answered and changes nothing else.

A hypothesis fuzz over the client message grammar — valid messages, each field swapped for junk
(wrong types, huge numbers, lone surrogates written as JSON escapes, nested junk), unknown and extra
fields, text that is not JSON, binary frames — sent in batches over one socket, while a witness
session on another socket streams on. Every message gets exactly one answer (``ack`` or ``error``),
none is ``internal``, no session ends, and the witness receives every chunk index exactly once.

``ARSTREAM_FUZZ_BATCHES`` (default 25 batches of 50 messages) makes a longer run.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.frames import Opcode
from websockets.sync.client import connect

from tests.conftest import start_server
from tests.raw_ws import RawWebSocket

BATCH = 50
BATCHES = int(os.environ.get("ARSTREAM_FUZZ_BATCHES", "25"))
MAX_TEXT_BYTES = 12 * 1024  # under the server's 16 KiB message limit (over it is a 1009 close, tested elsewhere)
REPLY_TIMEOUT_S = 60

# --- the grammar ------------------------------------------------------------------------------------

lone_surrogate = st.integers(0xD800, 0xDFFF).map(chr)
any_character = st.one_of(st.characters(), lone_surrogate, st.sampled_from("\x00\x1f\u2028\ufeff\U0010ffff"))
junk_text = st.text(any_character, max_size=40)
huge_numbers = st.sampled_from([10**30, -(10**30), 2**63, 2**64, -1, 1e308, -1e308, 5e-324, 0.5, 10**4000])
scalar_junk = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                        huge_numbers, junk_text)
junk = st.recursive(scalar_junk, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(junk_text, inner,
                                                                                              max_size=4),
                    max_leaves=12)

prompt_text = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=60).filter(
    lambda text: not text.isspace()
)
message_id = st.none() | st.text(st.characters(exclude_categories=("Cs",)), max_size=64)
options = st.fixed_dictionaries({}, optional={"pace": st.booleans(), "negative_prompt": st.text(max_size=30),
                                              "guidance": st.just(1.0)})
valid_message = st.one_of(
    st.fixed_dictionaries({"type": st.just("start"), "prompt": prompt_text},
                          optional={"seed": st.integers(0, 2**63 - 1), "options": options, "id": message_id}),
    st.fixed_dictionaries({"type": st.just("prompt"), "prompt": prompt_text},
                          optional={"policy": st.sampled_from(["soft", "recache", "reset"]), "id": message_id}),
    *[st.fixed_dictionaries({"type": st.just(kind)}, optional={"id": message_id})
      for kind in ("pause", "resume", "reset")],
)


@st.composite
def mutated_message(draw) -> dict:
    """A valid message with one thing wrong: a field's value swapped for junk, a field added or removed."""
    message = dict(draw(valid_message))
    how = draw(st.sampled_from(["replace", "extra", "drop_type", "close_with_extra"]))
    if how == "replace":
        field = draw(st.sampled_from(sorted(message) + ["id", "seed", "options", "policy", "prompt"]))
        message[field] = draw(junk)
    elif how == "extra":
        key = draw(junk_text | st.sampled_from(["volume", "__proto__", "constructor", "type "]))
        if key not in message:
            message[key] = draw(junk)
        else:
            message["seed"] = "1"  # a number as a string is not a number
    elif how == "drop_type":
        message.pop("type")
    else:  # a close that must be refused, never applied: it would end the session
        message = {"type": "close", draw(st.sampled_from(["now", "force", "\ud800"])): draw(scalar_junk)}
    return message


def as_json(message: dict) -> str:
    """``ensure_ascii`` writes lone surrogates as ``\\udXXX`` escapes: valid JSON text, invalid Unicode."""
    return json.dumps(message, ensure_ascii=True)


frame = st.one_of(
    valid_message.map(as_json),
    mutated_message().map(as_json),
    junk.map(lambda value: json.dumps(value, ensure_ascii=True)),  # JSON, but not an object with a type
    st.text(max_size=200),  # not JSON at all (mostly)
    st.sampled_from(['{"type": "pause", "id": "\\ud800"}', '{"type":"start","prompt":"x","seed":NaN}',
                     '{"type":"pause"', "[" * 5000, '{"type":"pause","id":' + "1" * 5000 + "}",
                     '{"type":"start","prompt":"\\udc00\\ud800"}', '{"type":"resume","id":"\\u0000"}']),
    st.binary(max_size=200),  # a binary frame: only JSON text is accepted
).filter(lambda data: len(data.encode("utf-8") if isinstance(data, str) else data) <= MAX_TEXT_BYTES)


# --- the server and the witness -------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    # A generous control rate: the fuzz is about validation, not the rate limit (tested elsewhere).
    running = start_server("--max-sessions", "4",
                           env={"ARSTREAM_CONTROL_RATE_PER_S": "1000", "ARSTREAM_CONTROL_BURST": "1000"})
    try:
        yield running
    finally:
        running.stop()


class Witness(threading.Thread):
    """A paced session that must see every chunk index exactly once, whatever happens next door."""

    def __init__(self, ws) -> None:
        super().__init__(daemon=True)
        self.ws = ws
        self.session_id = json.loads(self.ws.recv(REPLY_TIMEOUT_S))["session_id"]
        self.ws.recv(REPLY_TIMEOUT_S)  # init
        self.ws.send(json.dumps({"type": "start", "prompt": "the witness", "seed": 7}))
        self.indexes: list[int] = []
        self.others: list[dict] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                message = self.ws.recv(0.2)
            except TimeoutError:
                continue
            parsed = json.loads(message)
            if parsed["type"] == "chunk":
                assert isinstance(self.ws.recv(REPLY_TIMEOUT_S), bytes)
                self.indexes.append(parsed["index"])
            else:
                self.others.append(parsed)


def get_json(base_url: str, path: str) -> dict:
    with urllib.request.urlopen(base_url + path, timeout=10) as response:
        return json.loads(response.read())


def answers(ws, count: int) -> list[dict]:
    """The next ``count`` acks/errors (chunks with their segments and state messages are skipped)."""
    got = []
    deadline = time.monotonic() + REPLY_TIMEOUT_S
    while len(got) < count:
        message = ws.recv(max(0.1, deadline - time.monotonic()))
        assert isinstance(message, str), "a media segment without its chunk message"
        parsed = json.loads(message)  # every server message is valid JSON text, whatever it answers
        if parsed["type"] == "chunk":
            assert isinstance(ws.recv(REPLY_TIMEOUT_S), bytes)
        elif parsed["type"] in ("ack", "error"):
            got.append(parsed)
        else:
            assert parsed["type"] == "state", parsed  # never `closed`
    return got


# --- the fuzz ---------------------------------------------------------------------------------------


def test_fuzzed_messages_are_each_answered_and_end_no_session(server):
    with connect(f"{server.ws_url}/v1/stream", compression=None, max_size=2**24) as witness_ws, \
            connect(f"{server.ws_url}/v1/stream", compression=None, max_size=2**24) as fuzzed:
        fuzz(server, Witness(witness_ws), fuzzed)


def fuzz(server, witness: Witness, fuzzed) -> None:
    witness.start()
    fuzz_session = json.loads(fuzzed.recv(REPLY_TIMEOUT_S))["session_id"]
    fuzzed.recv(REPLY_TIMEOUT_S)
    codes: dict[str, int] = {}
    sent = 0

    @settings(max_examples=BATCHES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(frame, min_size=BATCH, max_size=BATCH))
    def batch(frames: list) -> None:
        nonlocal sent
        for data in frames:
            fuzzed.send(data)
        replies = answers(fuzzed, len(frames))
        sent += len(frames)
        for reply in replies:
            if reply["type"] == "error":
                assert reply["code"] != "internal", "\n".join([str(reply), *server.log_lines[-12:]])  # with why
                codes[reply["code"]] = codes.get(reply["code"], 0) + 1
            else:
                codes["ack"] = codes.get("ack", 0) + 1

    try:
        batch()
        fuzzed.send(json.dumps({"type": "pause", "id": "still-here"}))
        assert answers(fuzzed, 1)[0]["id"] == "still-here"  # the fuzzed socket itself is still served
        time.sleep(1.0)  # a chunk or two more for the witness
    finally:
        witness.stop.set()
        witness.join(REPLY_TIMEOUT_S)
    print(f"fuzzed {sent} messages: {codes}")

    assert sent >= BATCH * BATCHES
    assert {"ack", "invalid_field", "bad_json", "unknown_type"} <= set(codes), codes
    assert witness.indexes == list(range(len(witness.indexes))) and len(witness.indexes) >= 2
    assert not [m for m in witness.others if m["type"] in ("error", "closed")], witness.others
    for session_id in (fuzz_session, witness.session_id):
        assert get_json(server.base_url, f"/v1/sessions/{session_id}")["state"] != "closed"
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as response:
        metrics = response.read().decode()
    rejected = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("arstream_client_messages_rejected_total{") and 'via="socket"' in line)
    assert rejected >= sum(count for code, count in codes.items() if code != "ack")  # every refusal counted


def test_lone_surrogate_and_coerced_types_are_invalid_field_and_the_session_streams_on(server):
    with connect(f"{server.ws_url}/v1/stream", compression=None, max_size=2**24) as ws:
        session_id = json.loads(ws.recv(REPLY_TIMEOUT_S))["session_id"]
        ws.recv(REPLY_TIMEOUT_S)
        ws.send(json.dumps({"type": "start", "prompt": "still here", "options": {"pace": False}, "id": "s"}))
        assert answers(ws, 1)[0] == {"type": "ack", "id": "s", "of": "start"}
        refused = []
        for text in ['{"type":"pause","id":"\\ud800"}',  # the lone surrogate that used to end the session
                     '{"type":"prompt","prompt":"x\\udfff","id":"p"}',
                     '{"type":"start","prompt":"x","options":{"pace":"false"},"id":"b"}',
                     '{"type":"start","prompt":"x","seed":"1","id":"i"}',
                     '{"type":"pause","\\ud800":1,"id":"k"}']:
            ws.send(text)
            refused.extend(answers(ws, 1))
        assert [r["code"] for r in refused] == ["invalid_field"] * 5
        assert "id" not in refused[0]  # an id that is not valid Unicode is never echoed
        assert [r.get("id") for r in refused[1:]] == ["p", "b", "i", "k"]
        assert refused[4]["message"].startswith("<field>")  # nor is a field name that is not
        chunks_before = get_json(server.base_url, f"/v1/sessions/{session_id}")["counters"]["chunks"]
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while get_json(server.base_url, f"/v1/sessions/{session_id}")["counters"]["chunks"] <= chunks_before:
            assert time.monotonic() < deadline, "the session stopped streaming"
            answers_or_chunk = json.loads(ws.recv(REPLY_TIMEOUT_S))
            if answers_or_chunk["type"] == "chunk":
                ws.recv(REPLY_TIMEOUT_S)
        assert get_json(server.base_url, f"/v1/sessions/{session_id}")["state"] == "active"


def test_invalid_utf8_in_a_text_frame_closes_1007_and_only_detaches(server):
    raw = RawWebSocket(f"{server.ws_url}/v1/stream")
    session_id = json.loads(raw.receive())["session_id"]
    raw.receive()
    raw.send_frame(Opcode.TEXT, b'{"type":"pause","id":"\xed\xa0\x80"}')  # a surrogate, UTF-8-encoded
    with pytest.raises(ConnectionError, match="1007"):
        while True:
            raw.receive()
    raw.close()
    deadline = time.monotonic() + 10
    while get_json(server.base_url, f"/v1/sessions/{session_id}")["attached"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert get_json(server.base_url, f"/v1/sessions/{session_id}")["state"] == "detached"  # not ended
    with connect(f"{server.ws_url}/v1/sessions/{session_id}/stream", compression=None) as again:
        assert json.loads(again.recv(REPLY_TIMEOUT_S))["session_id"] == session_id


# --- REST: bodies, paths and query strings ----------------------------------------------------------


def raw_request(base_url: str, method: str, target: str, body: bytes | None = None) -> tuple[int, dict]:
    """A request whose target goes on the wire byte for byte (no client-side quoting)."""
    host, port = base_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.putrequest(method, target, skip_accept_encoding=True)
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str(len(body or b"")))
        connection.endheaders(body)
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        connection.close()


@pytest.mark.parametrize(
    ("method", "target", "body", "status", "code"),
    [
        ("GET", "/v1/sessions/%ED%A0%80", None, 400, "invalid_field"),  # a UTF-8-encoded surrogate
        ("GET", "/v1/sessions/%FF%FE", None, 400, "invalid_field"),
        ("GET", "/v1/sessions?owner=%C3", None, 400, "invalid_field"),
        ("POST", "/v1/sessions", b'{"prompt": "\\ud800"}', 400, "invalid_field"),
        ("POST", "/v1/sessions", b'{"prompt": "ok", "\\udc00": 1}', 400, "invalid_field"),
        ("POST", "/v1/sessions", b'{"prompt": "ok", "options": {"pace": "false"}}', 400, "invalid_field"),
        ("POST", "/v1/sessions", b'{"prompt": "ok", "seed": "1"}', 400, "invalid_field"),
        ("POST", "/v1/sessions", b'{"prompt": "ok", "seed": 1.0}', 400, "invalid_field"),
        ("POST", "/v1/sessions", b'{"prompt": "   "}', 400, "invalid_field"),
        ("POST", "/v1/sessions", b'{"prompt": "\xff\xfe"}', 400, "bad_json"),  # not UTF-8 at all
        ("POST", "/v1/sessions", b'{"prompt": "ok", "seed": 1' + b"0" * 5000 + b"}", 400, "bad_json"),  # as on the socket
    ],
)
def test_rest_input_is_valid_unicode_and_strictly_typed_or_refused(server, method, target, body, status, code):
    got_status, reply = raw_request(server.base_url, method, target, body)
    assert (got_status, reply["error"]["code"]) == (status, code), reply
    json.dumps(reply, ensure_ascii=False).encode("utf-8")  # the reply itself is valid Unicode
