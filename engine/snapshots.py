"""Taking a session's snapshot: the record as it will be once its queued controls apply, frozen."""

from __future__ import annotations

from collections.abc import Callable

from engine.controls import SessionState, SessionView
from engine.session_record import SessionRecord
from engine.status import ControlLatency, InputStatus, RealtimeStatus, SessionCounters, SessionStatus


def shown_state(projected: SessionView, *, draining: bool) -> str:
    """The protocol's state of a session: an open one shows ``detached`` without a consumer, and ``draining``
    while the engine drains."""
    if projected.state is SessionState.CLOSED:
        return projected.state.value
    if draining:
        return "draining"
    return "detached" if projected.detached else projected.state.value


def session_status(
    record: SessionRecord, *, draining: bool, below_realtime: bool, live_capacity: int | None,
    unknown_words: Callable[[str], tuple[str, ...] | None] = lambda prompt: None,
) -> SessionStatus:
    """``below_realtime``: the core's judgement for this session (shown only while it runs live);
    ``live_capacity``: the engine's; ``unknown_words``: the text encoder's reading of a prompt."""
    projected = record.projected()
    live_running = projected.pace and projected.state is SessionState.ACTIVE
    return SessionStatus(
        session_id=record.session_id,
        state=shown_state(projected, draining=draining),
        attached=projected.attached,
        seed=projected.seed,
        pace=projected.pace,
        prompt_length=len(projected.prompt or ""),
        prompt_unknown_words=_count(unknown_words(projected.prompt)) if projected.prompt else None,
        counters=SessionCounters(
            chunks=record.playout.chunks_released,
            frames=record.playout.frames_released,
            audio_samples=record.playout.audio_released,
            blocks_since_reset=record.blocks_since_reset,
            queue_depth=len(record.queue),
            decoder_state_bytes=record.decoder_state_bytes,
            encoder_state_bytes=record.encoder_state_bytes,
        ),
        created_at=record.created_at_epoch,
        started_at=record.started_at,
        ended_at=record.ended_at,
        time_to_first_chunk_ms=record.time_to_first_chunk_ms,
        last_timings=record.last_timings,
        close_reason=record.close_reason,
        error=record.error,
        realtime=RealtimeStatus(
            live=projected.pace,
            block_cost_ms=record.cost.seconds * 1000.0 if record.cost.samples else None,
            frames_per_second=record.frame_rate.per_second() if record.is_open else 0.0,
            deadline_misses=record.deadline_misses,
            below_realtime=live_running and below_realtime,
            live_capacity=live_capacity,
        ),
        input=InputStatus(
            live=record.live is not None,
            strength=record.live.strength if record.live is not None else None,
            frames_received=record.inputs.frames_received,
            frames_used=record.inputs.frames_used,
            frames_dropped=record.inputs.frames_dropped,
            frames_invalid=record.inputs.frames_invalid,
            context_frames=record.inputs.context_frames,
        ),
        control_latency=control_latency(record),
    )


def control_latency(record: SessionRecord) -> ControlLatency | None:
    latencies = [seconds for _, seconds in record.control_latencies]
    if not latencies:
        return None
    ordered = sorted(latencies)
    return ControlLatency(
        count=len(latencies),
        last_s=latencies[-1],
        median_s=ordered[len(ordered) // 2],
        p90_s=ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        max_s=ordered[-1],
    )


def _count(words: tuple[str, ...] | None) -> int | None:
    return None if words is None else len(words)
