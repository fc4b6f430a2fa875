"""A token sent where it does not belong — a URL's query string — never reaches the server's log."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request

from websockets.sync.client import connect

from app.log_redaction import RedactSecrets
from tests.conftest import start_server

TOKEN = "secret-token-0123456789abcdef"


def test_token_in_a_query_string_never_reaches_the_server_log():
    server = start_server("--log-format", "text", env={"ARSTREAM_TOKEN": TOKEN})
    try:
        authorised = {"Authorization": f"Bearer {TOKEN}"}
        for path, headers in [(f"/v1/sessions?token={TOKEN}", authorised),  # 200, access-logged
                              (f"/v1/sessions?access_token={TOKEN}&x=1", {}),  # 401
                              (f"/nowhere?token={TOKEN}", {})]:  # 404
            request = urllib.request.Request(server.base_url + path, headers=headers)
            try:
                urllib.request.urlopen(request, timeout=10).close()
            except urllib.error.HTTPError:
                pass
        # A socket, accepted (the server logs its target), with the token in the URL too.
        with connect(f"{server.ws_url}/v1/stream?token={TOKEN}", additional_headers=authorised,
                     compression=None) as ws:
            assert json.loads(ws.recv(30))["type"] == "session"
    finally:
        server.stop()
    log = "\n".join(server.log_lines)
    assert "/v1/sessions?<redacted>" in log  # the access log still shows the request ...
    assert "/v1/stream?<redacted>" in log
    assert TOKEN not in log  # ... but never the token


def test_redaction_covers_bearer_credentials_and_the_configured_token():
    redaction = RedactSecrets([TOKEN])
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", "/v1/sessions/x?token=abc", "1.1", 200), None)
    assert redaction.filter(record)
    assert record.getMessage() == '127.0.0.1:5 - "GET /v1/sessions/x?<redacted> HTTP/1.1" 200'
    record = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1,
                               f"offered Bearer abc.def and bearer.{TOKEN}, token {TOKEN} again", None, None)
    redaction.filter(record)
    assert record.getMessage() == "offered Bearer <redacted> and bearer.<redacted>, token <redacted> again"
