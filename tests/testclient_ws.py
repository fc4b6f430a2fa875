"""Helpers for protocol tests through FastAPI's TestClient sockets (the app in-process)."""

from __future__ import annotations

import json

from starlette.websockets import WebSocketDisconnect


def receive(ws) -> dict | bytes:
    """The next message: a parsed JSON object, or bytes; a close raises WebSocketDisconnect."""
    message = ws.receive()
    if message["type"] == "websocket.close":
        raise WebSocketDisconnect(message.get("code", 1000), message.get("reason", ""))
    return json.loads(message["text"]) if message.get("text") is not None else message["bytes"]


def hello(ws) -> dict:
    """The `session` message (the init segment that must follow it is checked and dropped)."""
    return hello_and_init(ws)[0]


def hello_and_init(ws) -> tuple[dict, bytes]:
    session = receive(ws)
    assert session["type"] == "session", session
    init = receive(ws)
    assert isinstance(init, bytes) and init[4:8] == b"ftyp"
    return session, init


def next_control(ws) -> dict:
    """The next message that is not a chunk (a chunk's JSON and its segment are skipped together)."""
    while True:
        message = receive(ws)
        if isinstance(message, bytes):
            raise AssertionError("a media segment without its chunk message")
        if message["type"] != "chunk":
            return message
        assert isinstance(receive(ws), bytes)


def next_chunk(ws, others: list | None = None) -> tuple[dict, bytes]:
    while True:
        message = receive(ws)
        assert not isinstance(message, bytes), "a media segment without its chunk message"
        if message["type"] == "chunk":
            segment = receive(ws)
            assert isinstance(segment, bytes)
            return message, segment
        if others is not None:
            others.append(message)


def until_closed(ws) -> tuple[list[dict], int]:
    """Every text message up to the close, and the close code."""
    texts = []
    while True:
        try:
            message = receive(ws)
        except WebSocketDisconnect as closed:
            return texts, closed.code
        if not isinstance(message, bytes):
            texts.append(message)


def start(ws, prompt="a red fox in snow", message_id="start-1", **fields) -> None:
    ws.send_json({"type": "start", "prompt": prompt, "id": message_id, **fields})
    assert next_control(ws) == {"type": "ack", "id": message_id, "of": "start"}
    assert next_control(ws) == {"type": "state", "state": "active"}
