"""A WebRTC peer's clock and its answer, without a network (app/transport/webrtc_media.py, app/transport/webrtc.py).

The peer sends each frame at its time on the viewer's clock: a frame that comes late is a stall that moves the
clock on (unless the engine restarted its own clock there: a resume), and the peer then catches up (frames a little sooner) so that one stall does not add to every later
control's time to the screen. Its answer puts the sound in a media stream of its own, so a browser does not
hold the video back to lip-sync it.
"""

from __future__ import annotations

import pytest

from app.transport.webrtc import audio_in_its_own_stream
from app.transport.webrtc_media import Timeline

FPS = 16
FRAME_S = 1 / FPS
MARGIN_S = 0.05


def _stream(timeline: Timeline, pieces: range, arrival_of) -> list[tuple[int, float, float]]:
    """(pts, arrived, shown) per frame: pieces of 4 frames, each arriving at ``arrival_of(first pts)``."""
    shown = []
    for piece in pieces:
        arrived = arrival_of(4 * piece)
        for pts in range(4 * piece, 4 * piece + 4):
            shown.append((pts, arrived, timeline.show_time(pts, arrived)))
    return shown


def test_frames_show_on_the_viewers_clock_and_a_piece_on_time_is_no_stall():
    timeline = Timeline(FPS, MARGIN_S)
    # The first piece shows on arrival (t = 10); later ones arrive the margin before their time.
    shown = _stream(timeline, range(40), lambda pts: 10.0 + (pts * FRAME_S - MARGIN_S if pts else 0.0))
    assert all(at == pytest.approx(10.0 + pts * FRAME_S) for pts, _, at in shown)
    assert timeline.stalls == 0 and timeline.caught_up_s == 0.0
    assert timeline.min_slack_s == pytest.approx(MARGIN_S)


def test_after_a_stall_the_peer_catches_up_with_the_engines_clock_a_little_at_a_time():
    timeline = Timeline(FPS, MARGIN_S)
    late_piece, late_by = 10, 0.2  # the piece at pts 40 comes 0.2 s after its time (0.25 s later than planned)

    def arrival(pts):
        engine_time = 10.0 + pts * FRAME_S  # when the engine's clock plays it
        if pts == 0:
            return engine_time
        return engine_time - MARGIN_S + (late_by + MARGIN_S if pts == 4 * late_piece else 0.0)

    shown = _stream(timeline, range(80), arrival)
    assert timeline.stalls == 1 and timeline.stalled_s == pytest.approx(late_by)
    behind = [at - (10.0 + pts * FRAME_S) for pts, _, at in shown]  # how far the peer shows after the engine's clock
    assert behind[4 * late_piece] == pytest.approx(late_by)  # the late frame shows on arrival
    # Then never further behind, never ahead, and each frame at most a tenth of a frame's time sooner than the last
    # (playback at most 1.1x) ...
    after = behind[4 * late_piece:]
    assert all(b >= -1e-9 for b in after)
    assert all(-1e-9 <= a - b <= Timeline.CATCH_UP_RATE * FRAME_S + 1e-9 for a, b in zip(after, after[1:]))
    # ... until it is back on the engine's clock, within the tolerance, in a few seconds of playback.
    assert behind[-1] <= Timeline.CATCH_UP_TOLERANCE_S + 1e-9
    assert timeline.caught_up_s == pytest.approx(late_by - behind[-1])
    # Every frame still shows no sooner than it arrived.
    assert all(at >= arrived - 1e-9 for _, arrived, at in shown)


def test_a_peer_that_gets_its_pieces_earlier_than_its_margin_does_not_run_ahead_of_the_engine():
    """Pieces that come ahead of the margin (an engine margin larger than the peer's) are no stall to make up:
    the peer catches up only what it fell behind, never past the engine's clock."""
    timeline = Timeline(FPS, MARGIN_S)
    shown = _stream(timeline, range(60), lambda pts: 10.0 + (pts * FRAME_S - 0.15 if pts else 0.0))
    assert all(at == pytest.approx(10.0 + pts * FRAME_S) for pts, _, at in shown)
    assert timeline.caught_up_s == 0.0


def test_a_restart_of_the_engines_clock_restarts_the_peers_and_is_no_stall():
    """After a pause the engine restarts the session's clock at the next chunk (``Chunk.starts_clock``): the peer
    shows it on arrival and goes on from there, and the pause's gap is counted as a restart, not a stall."""
    timeline = Timeline(FPS, MARGIN_S)
    shown = _stream(timeline, range(10), lambda pts: 10.0 + (pts * FRAME_S - MARGIN_S if pts else 0.0))
    resumed_at = 30.0  # 20 s of pause: pts 40 plays on arrival, and the rest on the new clock
    first = 40
    arrived = resumed_at
    assert timeline.show_time(first, arrived, restart=True) == resumed_at
    for pts in range(first + 1, first + 40):
        arrival = resumed_at + (pts - first) * FRAME_S - MARGIN_S
        shown.append((pts, arrival, timeline.show_time(pts, arrival)))
    assert all(at == pytest.approx(resumed_at + (pts - first) * FRAME_S) for pts, _, at in shown[40:])
    assert timeline.stalls == 0 and timeline.stalled_s == 0.0 and timeline.restarts == 1
    assert timeline.caught_up_s == 0.0
    # Without the restart the same gap is a 20 s stall (what the peer's log counted before).
    stalled = Timeline(FPS, MARGIN_S)
    _stream(stalled, range(10), lambda pts: 10.0 + (pts * FRAME_S - MARGIN_S if pts else 0.0))
    stalled.show_time(first, resumed_at)
    assert stalled.stalls == 1 and stalled.stalled_s == pytest.approx(resumed_at - (10.0 + first * FRAME_S))


ANSWER = (
    "v=0\r\n"
    "o=- 3912 3912 IN IP4 0.0.0.0\r\n"
    "s=-\r\n"
    "t=0 0\r\n"
    "a=group:BUNDLE 0 1 2\r\n"
    "a=msid-semantic:WMS *\r\n"
    "m=video 9 UDP/TLS/RTP/SAVPF 96\r\n"
    "a=mid:0\r\n"
    "a=msid:5c0d1e7a 9a1f-video\r\n"
    "a=ssrc:1111 cname:peer\r\n"
    "m=audio 9 UDP/TLS/RTP/SAVPF 111\r\n"
    "a=mid:1\r\n"
    "a=msid:5c0d1e7a 77b2-audio\r\n"
    "a=ssrc:2222 cname:peer\r\n"
    "m=application 9 UDP/DTLS/SCTP webrtc-datachannel\r\n"
    "a=mid:2\r\n"
)


def test_the_answer_puts_the_sound_in_a_media_stream_of_its_own():
    answer = audio_in_its_own_stream(ANSWER)
    lines = answer.split("\r\n")
    video = next(line for line in lines if line.startswith("a=msid:") and line.endswith("-video"))
    audio = next(line for line in lines if line.startswith("a=msid:") and line.endswith("-audio"))
    assert video == "a=msid:5c0d1e7a 9a1f-video"  # the video's stream as it was
    stream = audio.split(" ")[0][len("a=msid:"):]
    assert stream != "5c0d1e7a" and audio.split(" ")[1] == "77b2-audio"  # another stream, the same track
    # Nothing else changed: same lines, same order, same line ends.
    assert [line for line in lines if not line.startswith("a=msid:")] == \
        [line for line in ANSWER.split("\r\n") if not line.startswith("a=msid:")]
    assert audio_in_its_own_stream("v=0\r\nm=video 9 UDP/TLS/RTP/SAVPF 96\r\na=msid:s t\r\n") == \
        "v=0\r\nm=video 9 UDP/TLS/RTP/SAVPF 96\r\na=msid:s t\r\n"
