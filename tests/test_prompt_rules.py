"""One set of prompt rules (engine/prompts.py) at every entry point: the function itself, the socket,
REST, and the engine API; `arstream generate` is covered by tests/test_cli_errors.py."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequest, PromptTooLong
from engine.prompts import MAX_PROMPT_CHARS, check_prompt
from tests.testclient_ws import next_control

WHITESPACE_ONLY = [" ", "\t\n", "\u00a0\u2003", "\u3000 \r\n"]  # ASCII and Unicode white space


@pytest.mark.parametrize("prompt", WHITESPACE_ONLY + [""])
def test_empty_and_whitespace_only_prompts_are_invalid(prompt):
    with pytest.raises(InvalidRequest, match="prompt must not be") as refused:
        check_prompt(prompt)
    assert type(refused.value) is InvalidRequest and refused.value.code == "invalid_field"


def test_length_is_counted_in_characters_and_over_long_has_its_own_code():
    assert check_prompt("é" * MAX_PROMPT_CHARS) == "é" * MAX_PROMPT_CHARS  # 4000 UTF-8 bytes, 2000 characters
    with pytest.raises(PromptTooLong) as refused:
        check_prompt(" " * (MAX_PROMPT_CHARS + 1))  # too long is reported before whitespace
    assert refused.value.code == "prompt_too_long"


def test_text_is_returned_unchanged_and_negative_prompts_may_be_empty():
    assert check_prompt("  a fox  ") == "  a fox  "
    assert check_prompt("", allow_empty=True) == ""
    with pytest.raises(InvalidRequest, match="negative_prompt must not be only whitespace"):
        check_prompt("  ", allow_empty=True, field="negative_prompt")
    with pytest.raises(InvalidRequest, match="lone surrogate"):
        check_prompt("a \ud800 b")
    with pytest.raises(InvalidRequest, match="must be a string"):
        check_prompt(42)


def test_socket_and_rest_refuse_a_whitespace_only_prompt(make_client):
    with make_client() as client:
        with client.websocket_connect("/v1/stream") as ws:
            assert next_control(ws)["type"] == "session"
            ws.receive_bytes()  # init segment
            ws.send_json({"type": "start", "id": "s", "prompt": " \n\t "})
            reply = next_control(ws)
            assert reply["type"] == "error" and reply["code"] == "invalid_field" and reply.get("id") == "s", reply
            ws.send_json({"type": "start", "id": "ok", "prompt": "a fox"})  # the socket and session live on
            assert next_control(ws) == {"type": "ack", "id": "ok", "of": "start"}
        refused = client.post("/v1/sessions", json={"prompt": "\u3000"})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_field", refused.text
