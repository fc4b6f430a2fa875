"""Example arstream client (protocol v1): stream a session to an MP4 file, changing the prompt half-way.

    python examples/client.py --url ws://127.0.0.1:8000 --prompt "a red fox in snow" \
        --then "a red fox in a forest" --seconds 10 --out fox.mp4

With a token configured on the server, set ARSTREAM_TOKEN (it is sent as `Authorization: Bearer`).
The file is the init segment followed by every media segment, exactly as received: a valid MP4.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from websockets.asyncio.client import connect


async def stream(args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {os.environ['ARSTREAM_TOKEN']}"} if os.environ.get("ARSTREAM_TOKEN") else {}
    async with connect(
        f"{args.url.rstrip('/')}/v1/stream",
        subprotocols=["arstream.v1"],
        additional_headers=headers,
        compression=None,  # the server does not deflate; media would not shrink anyway
        max_size=64 * 2**20,
    ) as ws:
        with open(args.out, "wb") as out:
            return await _receive(ws, out, args)


async def _receive(ws, out, args: argparse.Namespace) -> int:
    """Write the init segment and every media segment to ``out``; print events; close after ``--seconds``."""
    session = json.loads(await ws.recv())
    if session.get("type") != "session":
        print(f"refused: {session}", file=sys.stderr)
        return 1
    print(f"session {session['session_id']}: {session['mime']}, "
          f"{session['video']['width']}x{session['video']['height']} @ {session['video']['fps']} fps")
    out.write(await ws.recv())  # the init segment always follows `session`

    start = {"type": "start", "id": "start", "prompt": args.prompt, "options": {"pace": not args.no_pace}}
    if args.seed is not None:
        start["seed"] = args.seed
    await ws.send(json.dumps(start))

    fps = session["video"]["fps"]
    total_frames = int(args.seconds * fps)
    frames, prompt_changed, closing = 0, args.then is None, False
    while True:
        message = await ws.recv()
        if isinstance(message, bytes):  # the media segment of the chunk announced just before
            out.write(message)
            continue
        event = json.loads(message)
        kind = event["type"]
        if kind == "chunk":
            frames += event["frames"]
            timings = event["timings"]
            print(f"chunk {event['index']:4d}  pts {event['pts']:6d}  denoise {timings['denoise_ms']:7.1f} ms"
                  f"  decode {timings['decode_ms']:7.1f} ms  encode {timings['encode_ms']:6.1f} ms")
            if not prompt_changed and frames >= total_frames // 2:
                await ws.send(json.dumps({"type": "prompt", "id": "change", "prompt": args.then}))
                prompt_changed = True
            if frames >= total_frames and not closing:
                await ws.send(json.dumps({"type": "close", "id": "close"}))
                closing = True
        elif kind == "error":
            print(f"error {event['code']}: {event['message']} (for {event.get('id')})", file=sys.stderr)
        elif kind == "closed":
            print(f"closed: {event['reason']}; wrote {frames} frames to {args.out}")
            return 0 if event["reason"] == "client" else 1
        else:  # ack, state
            print(json.dumps(event))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="ws://127.0.0.1:8000")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--then", default=None, help="prompt to switch to half-way through")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--no-pace", action="store_true", help="generate as fast as the server can")
    parser.add_argument("--out", default="arstream.mp4")
    return asyncio.run(stream(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
