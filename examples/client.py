"""Example arstream client (protocol v1): stream a session to an MP4 file, changing the prompt half-way.

    python examples/client.py --url ws://127.0.0.1:8000 --prompt "a red fox in snow" \
        --then "a red fox in a forest" --seconds 10 --out fox.mp4

With a token configured on the server, set ARSTREAM_TOKEN (it is sent as `Authorization: Bearer`).
The file is the init segment followed by every media segment, exactly as received: a valid MP4. It is
created with the first media segment, so a session that produced nothing leaves no file.

Exit status: 0 when the clip was received and the session closed normally; 1 when the server refused
or ended the session (its `error` / `closed` message is printed), the connection failed or went
silent for --timeout seconds; 2 for bad arguments; 130 on Ctrl-C (what was received is kept).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

MAX_PROMPT_CHARS = 2000  # docs/PROTOCOL.md; the server checks again and answers `error` if it disagrees
MAX_SEED = 2**63 - 1
CONNECT_TIMEOUT_S = 10.0


class ClientError(Exception):
    """Ends the run with one line on stderr and exit status 1."""


async def stream(args: argparse.Namespace) -> int:
    token = os.environ.get("ARSTREAM_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        ws = await connect(
            args.url,
            subprotocols=["arstream.v1"],
            additional_headers=headers,
            compression=None,  # the server does not deflate; media would not shrink anyway
            max_size=64 * 2**20,
            open_timeout=CONNECT_TIMEOUT_S,
            close_timeout=5,
        )
    except (OSError, TimeoutError, InvalidHandshake, InvalidURI) as error:
        raise ClientError(f"cannot connect to {args.url}: {_describe(error)}") from None
    output = LazyFile(args.out)
    try:
        async with ws:
            return await Session(ws, output, args).run()
    except ConnectionClosed as error:
        raise ClientError(f"the server closed the connection ({_close_text(error)}); {output.summary()}") from None
    finally:
        output.close()


class LazyFile:
    """The output MP4: opened with the first media segment; the init segment waits until then."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.init: bytes | None = None
        self.file = None
        self.segments = 0

    def write_init(self, data: bytes) -> None:
        self.init = data

    def write_segment(self, data: bytes) -> None:
        if self.file is None:
            self.file = open(self.path, "wb")
            self.file.write(self.init or b"")
        self.file.write(data)
        self.segments += 1

    def summary(self) -> str:
        return f"wrote {self.segments} media segments to {self.path}" if self.segments else "no media received, no file written"

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class Session:
    """One session on an open socket: start, receive, switch the prompt, close after --seconds."""

    def __init__(self, ws, output: LazyFile, args: argparse.Namespace) -> None:
        self.ws, self.output, self.args = ws, output, args
        self.frames = 0

    async def receive(self):
        try:
            return await asyncio.wait_for(self.ws.recv(), timeout=self.args.timeout)
        except TimeoutError:
            raise ClientError(f"no message from the server for {self.args.timeout:g} s; {self.output.summary()}") from None

    async def run(self) -> int:
        session = json.loads(await self.receive())
        if session.get("type") != "session":
            return self.ended(session)
        video = session["video"]
        print(f"session {session['session_id']}: {session['mime']}, "
              f"{video['width']}x{video['height']} @ {video['fps']} fps")
        init = await self.receive()  # the init segment always follows `session`
        if not isinstance(init, bytes):
            raise ClientError("the server sent no init segment after `session`")
        self.output.write_init(init)

        start = {"type": "start", "id": "start", "prompt": self.args.prompt, "options": {"pace": not self.args.no_pace}}
        if self.args.seed is not None:
            start["seed"] = self.args.seed
        if self.args.guidance is not None:
            start["options"]["guidance"] = self.args.guidance
        await self.ws.send(json.dumps(start))

        total_frames = max(1, math.ceil(self.args.seconds * video["fps"]))
        prompt_changed, closing = self.args.then is None, False
        while True:
            message = await self.receive()
            if isinstance(message, bytes):  # the media segment of the chunk announced just before
                self.output.write_segment(message)
                continue
            event = json.loads(message)
            kind = event.get("type")
            if kind == "chunk":
                self.frames += event["frames"]
                timings = event["timings"]
                print(f"chunk {event['index']:4d}  pts {event['pts']:6d}  denoise {timings['denoise_ms']:7.1f} ms"
                      f"  decode {timings['decode_ms']:7.1f} ms  encode {timings['encode_ms']:6.1f} ms")
                if not prompt_changed and self.frames >= total_frames // 2:
                    await self.ws.send(json.dumps({"type": "prompt", "id": "change", "prompt": self.args.then}))
                    prompt_changed = True
                if self.frames >= total_frames and not closing:
                    await self.ws.send(json.dumps({"type": "close", "id": "close"}))
                    closing = True
            elif kind in ("error", "closed"):
                return self.ended(event)
            else:  # ack, state
                print(json.dumps(event))

    def ended(self, event: dict) -> int:
        """`closed` (client) after our own `close` is success; any other `error` / `closed` ends the run."""
        kind = event.get("type")
        if kind == "closed" and event.get("reason") == "client":
            print(f"closed: client; {self.frames} frames, {self.output.summary()}")
            return 0
        if kind == "error":
            answered = f" (answering {event['id']})" if event.get("id") else ""
            raise ClientError(f"server error {event.get('code')}{answered}: {event.get('message')}; {self.output.summary()}")
        if kind == "closed":
            retry = event.get("retry_after_s")
            hint = f", try again in {retry:g} s" if isinstance(retry, (int, float)) else ""
            raise ClientError(f"server closed the session: {event.get('reason')}{hint}; {self.output.summary()}")
        raise ClientError(f"unexpected first message from the server: {json.dumps(event)[:200]}")


def _describe(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return f"no answer within {CONNECT_TIMEOUT_S:g} s"
    response = getattr(error, "response", None)
    if response is not None:  # InvalidStatus: the handshake was answered with an HTTP status
        return f"HTTP {response.status_code} (a wrong token, a refused origin, or not an arstream server)"
    return str(error) or type(error).__name__


def _close_text(error: ConnectionClosed) -> str:
    frame = error.rcvd
    return f"code {frame.code}{' ' + frame.reason if frame.reason else ''}" if frame is not None else "no close frame"


# --- arguments ---------------------------------------------------------------------------------------


def _stream_url(value: str) -> str:
    """ws:// or wss:// only; a bare server address gets the protocol's /v1/stream path."""
    parts = urlsplit(value)
    if parts.scheme not in ("ws", "wss"):
        hint = {"http": "ws", "https": "wss"}.get(parts.scheme)
        suggestion = f" (for {parts.scheme}:// use {hint}://)" if hint else ""
        raise argparse.ArgumentTypeError(f"{value!r} is not a ws:// or wss:// URL{suggestion}")
    if not parts.hostname:
        raise argparse.ArgumentTypeError(f"{value!r} has no host")
    return value.rstrip("/") + "/v1/stream" if parts.path in ("", "/") else value


def _prompt(value: str) -> str:
    if not value or value.isspace():
        raise argparse.ArgumentTypeError("must not be empty or only whitespace")
    if len(value) > MAX_PROMPT_CHARS:
        raise argparse.ArgumentTypeError(f"longer than {MAX_PROMPT_CHARS} characters ({len(value)})")
    return value


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not (math.isfinite(seconds) and 0 < seconds <= 24 * 3600):
        raise argparse.ArgumentTypeError(f"{value} must be in (0, 86400]")
    return seconds


def _seed(value: str) -> int:
    try:
        seed = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if not 0 <= seed <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"{value} must be in [0, 2**63 - 1]")
    return seed


def _out(value: str) -> Path:
    path = Path(value)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{value} is a directory")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{value}: directory {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{value}: directory {path.parent} is not writable")
    return path


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--url", type=_stream_url, default="ws://127.0.0.1:8000",
                        help="server (ws:// or wss://), or a session's stream_url")
    parser.add_argument("--prompt", type=_prompt, required=True, help="what to generate (1-2000 characters)")
    parser.add_argument("--then", type=_prompt, default=None, help="prompt to switch to half-way through")
    parser.add_argument("--seed", type=_seed, default=None, help="noise seed (default: the server picks one)")
    parser.add_argument("--guidance", type=float, default=None,
                        help="must equal the server's guidance scale (default: the server's)")
    parser.add_argument("--seconds", type=_seconds, default=10.0, help="how much video to receive")
    parser.add_argument("--timeout", type=_seconds, default=30.0,
                        help="give up when the server sends nothing for this many seconds")
    parser.add_argument("--no-pace", action="store_true", help="generate as fast as the server can")
    parser.add_argument("--out", type=_out, default=Path("arstream.mp4"), help="MP4 file to write")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return asyncio.run(stream(args))
    except ClientError as error:
        print(f"client: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"client: interrupted; what was received is in {args.out} (if anything was)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
