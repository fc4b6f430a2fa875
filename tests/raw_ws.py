"""A WebSocket client on a plain blocking socket (websockets' Sans-I/O protocol), for tests that need to
control the socket itself: a tiny receive buffer, a client that stops reading or never answers pings,
or frames no well-behaved client library would send (invalid UTF-8 in a text frame).
"""

from __future__ import annotations

import json
import socket
from collections import deque

from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.uri import parse_uri

TIMEOUT_S = 60


class RawWebSocket:
    def __init__(self, url: str, *, receive_buffer_bytes: int | None = None, answer_pings: bool = True) -> None:
        uri = parse_uri(url)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if receive_buffer_bytes is not None:
            # Before connect, so the window the server sees is small from the start.
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes)
        self.sock.settimeout(TIMEOUT_S)
        self.sock.connect((uri.host, uri.port))
        self.answer_pings = answer_pings
        self.protocol = ClientProtocol(uri, max_size=2**24)
        self.protocol.send_request(self.protocol.connect())
        self.events: deque = deque()
        self.flush()
        response = self._next_event()
        if not (isinstance(response, Response) and response.status_code == 101):
            raise ConnectionError(f"handshake refused: {response}")

    def flush(self) -> None:
        for data in self.protocol.data_to_send():
            if data:
                self.sock.sendall(data)

    def _next_event(self):
        while not self.events:
            data = self.sock.recv(1 << 16)
            self.protocol.receive_data(data)
            if self.answer_pings:
                self.flush()  # websockets queues the pong itself
            else:
                self.protocol.data_to_send()  # drop it: this client "never answers"
            self.events.extend(self.protocol.events_received())
            if not data:
                raise ConnectionError("server closed the connection")
        return self.events.popleft()

    def receive(self) -> str | bytes:
        """The next text or binary message; :class:`ConnectionError` once the server closed."""
        while True:
            event = self._next_event()
            if isinstance(event, Frame):
                if event.opcode is Opcode.TEXT:
                    return event.data.decode()
                if event.opcode is Opcode.BINARY:
                    return bytes(event.data)
                if event.opcode is Opcode.CLOSE:
                    raise ConnectionError(f"closed by the server: {self.protocol.close_rcvd}")

    def receive_json(self) -> dict:
        message = self.receive()
        if not isinstance(message, str):
            raise AssertionError("expected a text message")
        return json.loads(message)

    def send_json(self, message: dict) -> None:
        self.protocol.send_text(json.dumps(message).encode())
        self.flush()

    def send_frame(self, opcode: Opcode, payload: bytes) -> None:
        """Any frame, even one the protocol forbids (the server must cope)."""
        self.protocol.send_frame(Frame(opcode, payload))
        self.flush()

    def close(self) -> None:
        self.sock.close()
