"""WebRTC beside the WebSocket (app/transport/webrtc.py), against a real `arstream serve` and a real aiortc peer.

The tiny preset's shipped weights at their own size, so the frames can be read: a peer negotiates, receives frames
of the prompt's colours, changes the prompt over the data channel and sees the new colour, and closes. Bad offers
and bad peers get clear errors and cost no other session anything; a peer whose client vanishes releases what
its session held.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import httpx
import pytest

from tests.conftest import start_server
from tests.webrtc_peer import Peer
from world.measure import colour_name, read_frame

TIMEOUT_S = 120


@pytest.fixture(scope="module")
def server():
    # The shipped tiny weights at their own size (256x144, where the world's reader reads them), no warm-up; two
    # peers per address (the limit test needs a low one); a short grace and peer timeout so a vanished client's
    # session ends within the test.
    running = start_server(
        "--preset", "tiny", "--warmup-blocks", "0", "--max-sessions", "4",
        "--detach-grace-s", "1",
        env={"ARSTREAM_MAX_PEERS_PER_CLIENT": "2", "ARSTREAM_WEBRTC_PEER_TIMEOUT_S": "1.5"},
        small=False,
    )
    try:
        yield running
    finally:
        running.stop()


def _colours(frames) -> list[str | None]:
    return [colour_name(read_frame(rgb)) for _, rgb in frames]


def _sessions(server) -> list[dict]:
    with urllib.request.urlopen(f"{server.base_url}/v1/sessions", timeout=10) as response:
        return [s for s in json.loads(response.read())["sessions"] if s["state"] != "closed"]


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT_S))


def test_a_peer_streams_the_prompts_colours_follows_a_change_is_replaced_by_a_second_offer_and_ends_on_delete(server):
    async def scenario():
        peer = Peer()
        answer = await peer.connect(server.base_url)
        assert answer.status_code == 201 and answer.headers["content-type"].startswith("application/sdp")
        # The sound is in a media stream of its own: a browser does not hold the video back to lip-sync it.
        streams = {}
        for section in answer.text.split("m=")[1:]:
            msid = next((line for line in section.splitlines() if line.startswith("a=msid:")), None)
            if msid is not None:
                streams[section.split(" ", 1)[0]] = msid[len("a=msid:"):].split(" ")[0]
        assert set(streams) == {"video", "audio"} and streams["video"] != streams["audio"], streams
        session = await peer.wait_for(lambda m: m["type"] == "session")
        assert session["transport"] == "webrtc" and session["video"]["codec"] in ("h264", "vp8")
        assert answer.headers["location"] == f"/v1/sessions/{session['session_id']}/webrtc"
        peer.send(type="start", prompt="a red square drifting on a blue background", seed=3, id="s")
        await peer.wait_for(lambda m: m["type"] == "ack" and m["id"] == "s")
        while len(peer.frames) < 40:
            await asyncio.sleep(0.05)
        red = _colours(peer.frames[-16:])
        peer.send(type="prompt", prompt="a yellow square drifting on a blue background", policy="soft", id="p")
        named = await peer.wait_for(lambda m: m["type"] == "chunk" and "p" in m.get("controls", ()))
        named_at = time.monotonic()
        while not peer.frames or peer.frames[-1][0] < named_at + 1.5:
            await asyncio.sleep(0.05)
        yellow = _colours([f for f in peer.frames if f[0] > named_at + 0.75])
        # A second offer for the session (a reload, a new network): it attaches, the first peer is told `replaced`.
        again = Peer()
        reattached = await again.connect(server.base_url, answer.headers["location"])
        replaced = await peer.wait_for(lambda m: m["type"] == "closed")
        hello = await again.wait_for(lambda m: m["type"] == "session")
        frames_then = len(again.frames)
        while len(again.frames) < frames_then + 8:
            await asyncio.sleep(0.05)
        await peer.close()
        # DELETE on the resource ends the session: its peer hears `closed` (client).
        async with httpx.AsyncClient(base_url=server.base_url) as http:
            deleted = await http.delete(answer.headers["location"])
        closed = await again.wait_for(lambda m: m["type"] == "closed")
        await again.close()
        return red, yellow, named, (reattached.status_code, replaced, hello, session), (deleted.status_code, closed)

    red, yellow, named, reattach, (deleted, closed) = run(scenario())
    assert red.count("red") >= 12, red  # the prompt's object, as the world's reader sees it
    assert yellow.count("yellow") >= 0.75 * len(yellow), yellow  # the new colour, a moment after the change
    assert named["frames"] >= 1
    status, replaced, hello, session = reattach
    assert status == 201 and replaced["reason"] == "replaced" and hello["session_id"] == session["session_id"]
    assert deleted == 204 and closed["reason"] == "client"


def test_bad_offers_and_peers_get_clear_errors_and_cost_no_other_session(server):
    async def scenario():
        witness = Peer()
        assert (await witness.connect(server.base_url)).status_code == 201
        witness.send(type="start", prompt="a green circle orbiting on a black background", seed=1, id="w")
        await witness.wait_for(lambda m: m["type"] == "ack")
        answers = {}
        async with httpx.AsyncClient(base_url=server.base_url) as http:
            sdp = {"content-type": "application/sdp"}

            async def post(body, path="/v1/webrtc"):
                reply = await http.post(path, content=body, headers=sdp)
                return reply.status_code, reply.json()["error"]["code"] if reply.status_code >= 400 else None

            answers["not SDP"] = await post("hello")
            answers["malformed SDP"] = await post("v=0\r\nm=video this is not an SDP offer\r\n")
            answers["over 64 KiB"] = await post("v=0\r\n" + "a=x\r\n" * 20000)
            answers["no video"] = await post(await Peer(video="", audio=True).offer())
            answers["sends video only"] = await post(await Peer(video="sendonly").offer())
            answers["unknown session"] = await post(await Peer().offer(), "/v1/sessions/AAAAAAAAAAAAAAAAAAAAAA/webrtc")
        # The witness holds one peer of this address's two; one more connects (best effort: this CPU keeps one live
        # session in real time), the next is refused.
        second = Peer()
        assert (await second.connect(server.base_url, "/v1/webrtc?pace=false")).status_code == 201
        third = Peer()
        refused = await third.connect(server.base_url, "/v1/webrtc?pace=false")
        answers["a third peer from one address"] = (refused.status_code, refused.json()["error"]["code"])
        await third.close()
        # A flood of messages on a data channel: refused beyond the rate, the session and the witness go on.
        second.send(type="start", prompt="a white square still on a grey background", seed=2, id="s2")
        await second.wait_for(lambda m: m["type"] == "ack")
        for index in range(150):
            second.send(type="pause" if index % 2 else "resume", id=f"f{index}")
        limited = await second.wait_for(lambda m: m["type"] == "error" and m["code"] == "rate_limited")
        second.channel.send(b"binary")  # no binary messages on this transport
        binary = await second.wait_for(lambda m: m["type"] == "error" and m["code"] == "bad_json")
        frames_before = len(witness.frames)
        await asyncio.sleep(1.5)
        witness_went_on = len(witness.frames) > frames_before + 10
        witness_errors = [m for m in witness.messages if m["type"] in ("error", "closed")]
        for peer in (second, witness):
            peer.send(type="close")
            await peer.wait_for(lambda m: m["type"] == "closed")
            await peer.close()
        return answers, limited, binary, witness_went_on, witness_errors

    answers, limited, binary, witness_went_on, witness_errors = run(scenario())
    assert answers == {
        "not SDP": (400, "invalid_field"), "malformed SDP": (400, "invalid_field"), "over 64 KiB": (413, "invalid_field"),
        "no video": (400, "invalid_field"), "sends video only": (400, "invalid_field"),
        "unknown session": (404, "unknown_session"), "a third peer from one address": (429, "rate_limited"),
    }, answers
    assert limited["id"].startswith("f") and "binary" in binary["message"]
    assert witness_went_on and not witness_errors


def test_a_client_that_vanishes_releases_its_session(server):
    """A peer killed mid-stream (no close, no goodbye): the server stops hearing it (ICE consent), the session
    detaches, and after the grace period the session table is back where it was."""
    baseline = len(_sessions(server))
    script = (
        "import asyncio, sys\n"
        "sys.path.insert(0, %r)\n"
        "from tests.webrtc_peer import Peer\n"
        "async def main():\n"
        "    peer = Peer()\n"
        "    assert (await peer.connect(%r)).status_code == 201\n"
        "    peer.send(type='start', prompt='a red circle bouncing on a blue background', seed=4, id='s')\n"
        "    await peer.wait_for(lambda m: m['type'] == 'chunk')\n"
        "    print('streaming', flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n"
    ) % (os.getcwd(), server.base_url)
    client = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline().strip() == "streaming"
        assert len(_sessions(server)) == baseline + 1
        client.send_signal(signal.SIGKILL)
        client.wait(timeout=10)
        deadline = time.monotonic() + 30
        while len(_sessions(server)) > baseline and time.monotonic() < deadline:
            time.sleep(0.25)
        assert len(_sessions(server)) == baseline
    finally:
        if client.poll() is None:
            client.kill()


def test_an_offers_mdns_candidates_are_left_out_and_the_rest_kept():
    """Browsers offer `<uuid>.local` names for their host addresses; resolving one that nobody answers held the
    answer for aioice's 1 s timeout (the demo page's first media 1.6 s). The peer connects without them (tested
    above with aiortc's own candidates; the demo page's test connects Chromium with mDNS ones)."""
    from app.transport.webrtc import without_mdns_candidates

    offer = ("v=0\r\nm=video 9 UDP/TLS/RTP/SAVPF 96\r\n"
             "a=candidate:1 1 udp 2113937151 47208585-18e5-4867-ae3d-4d3f2b1f0a11.local 54321 typ host\r\n"
             "a=candidate:2 1 udp 2113937151 192.0.2.7 5000 typ host\r\n"
             "a=candidate:3 1 udp 1677729535 198.51.100.9 6000 typ srflx raddr 0.0.0.0 rport 0\r\n"
             "a=end-of-candidates\r\n")
    kept = without_mdns_candidates(offer)
    assert ".local" not in kept and kept.count("a=candidate:") == 2 and kept.endswith("a=end-of-candidates\r\n")
    assert without_mdns_candidates(kept) == kept


def test_configured_stun_and_turn_servers_are_told_to_clients_as_whep_does(make_client, server):
    """`OPTIONS /v1/webrtc` says which STUN/TURN servers to use (`Link: <url>; rel="ice-server"`, a TURN server's
    credentials with it), under the same access rules as an offer; with none configured, no header. A bad entry
    is refused when the settings are read."""
    import pydantic

    from app.settings import IceServer

    servers = ["stun:stun.example.org:3478",
               {"urls": "turn:turn.example.net:3478?transport=udp", "username": "ada", "credential": "s3cret"}]
    with make_client(webrtc_ice_servers=servers, token="t0ken") as client:
        assert client.options("/v1/webrtc").status_code == 401
        told = client.options("/v1/webrtc", headers={"Authorization": "Bearer t0ken"})
        assert told.status_code == 204
        assert told.headers["link"] == (
            '<stun:stun.example.org:3478>; rel="ice-server", '
            '<turn:turn.example.net:3478?transport=udp>; rel="ice-server"; username="ada"; credential="s3cret"; '
            'credential-type="password"')
    told = httpx.options(f"{server.base_url}/v1/webrtc")  # the module's server: none configured
    assert told.status_code == 204 and "link" not in told.headers
    for bad in ("https://stun.example.org", {"urls": "turn:turn.example.net"}, "stun:a, <b>", "stun:x y"):
        with pytest.raises(pydantic.ValidationError):
            IceServer.model_validate(bad)
