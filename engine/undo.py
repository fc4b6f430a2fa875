"""Taking a session's last blocks back, so that a prompt change replaces media made ahead instead of waiting.

A paced session's lead (``engine/playout.py``) holds media made and not yet released. A soft or recache prompt
change that arrives while the lead holds frames of blocks already made can *supersede* them: the engine cuts
the lead at the first piece the viewer has not been sent, the runner takes the session back to the start of
that piece's block, and makes the block again under the new prompt — same history, same noise — sending its
frames from the cut on. The viewer sees the old block's frames up to the cut and the new block's after it: the
scene goes on where it was, with the change (docs/ENGINE.md, "The lead").

To take a block back, the runner keeps, for each of the session's last ``undo_blocks`` blocks, what the block
changed (:class:`BlockUndo`, recorded before the block runs):

* the KV commits it made — the blocks it wrote, and the window frames it evicted, which are *held* (not
  returned to the pool) until the record is settled: the pools reserve ``undo_blocks`` blocks' worth per
  session for them;
* the session's progress before it: the RNG's state (the block draws the same noise again), the resident clean
  latents (for a later recache), the block's input (live video) and the step it starts at;
* the streaming decoders' state before it (video and audio), cloned: the declared decoder bytes, per record,
  are reserved per session too — which is why superseding is on by default only for small decoder states;
* the block's clean latents, once made: taking the session back to the middle of a block decodes the old
  block's first latent frames again (their frames were sent) so the decoder's context is what the viewer saw.

A record is settled (its held frames freed, its snapshots dropped) once the engine says no piece of its block
can still be replaced, or when it is the oldest of more than ``undo_blocks``.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field

import torch

from engine.kv_cache import SessionKVState
from engine.models.latents import BlockLatents
from engine.models.pipeline import SessionProgress


def snapshot(state) -> dict:
    """A decoder state's fields, its tensors cloned (lists of tensors too): restorable with :func:`restore`."""
    copied = {}
    for item in dataclasses.fields(state):
        value = getattr(state, item.name)
        if torch.is_tensor(value):
            value = value.clone()
        elif isinstance(value, list):
            value = [entry.clone() if torch.is_tensor(entry) else entry for entry in value]
        copied[item.name] = value
    return copied


def restore(state, copied: dict) -> None:
    """Put a :func:`snapshot` back into ``state`` (the same object: its owner still knows it)."""
    for name, value in copied.items():
        setattr(state, name, list(value) if isinstance(value, list) else value)


@dataclass
class BlockUndo:
    """What one block changed on the device, to take it back."""

    block_index: int  # the session's progress.block_index before the block
    generator_state: torch.Tensor
    sink_latents: list[BlockLatents]
    window_latents: deque
    block_input: BlockLatents | None
    first_step: int
    decode_state: dict
    audio_state: dict | None
    audio_samples_to_trim: int
    audio_carry: torch.Tensor | None
    kv_journal: list[tuple[str, int, int | None]] = field(default_factory=list)
    clean_video: torch.Tensor | None = None  # the block's clean video latents (denormalized), once made


def before_block(progress: SessionProgress, kv: SessionKVState, decode_state, audio_state, *,
                 audio_samples_to_trim: int, audio_carry: torch.Tensor | None) -> BlockUndo:
    """Record the session as it is before its next block (and start journaling the block's commits)."""
    kv.begin_journal()
    return BlockUndo(
        block_index=progress.block_index,
        generator_state=progress.generator.get_state(),
        sink_latents=list(progress.sink_latents),
        window_latents=deque(progress.window_latents),
        block_input=progress.block_input,
        first_step=progress.first_step,
        decode_state=snapshot(decode_state),
        audio_state=snapshot(audio_state) if audio_state is not None else None,
        audio_samples_to_trim=audio_samples_to_trim,
        audio_carry=audio_carry,
    )


def take_back(records: list[BlockUndo], progress: SessionProgress, kv: SessionKVState, decode_state,
              audio_state) -> BlockUndo:
    """Undo ``records`` (the session's newest blocks, oldest first): KV commits newest first, then the session's
    state as it was before the oldest. Returns the oldest (its block is the one to make again)."""
    for record in reversed(records):
        kv.undo(record.kv_journal)
    oldest = records[0]
    progress.generator.set_state(oldest.generator_state)
    progress.block_index = oldest.block_index
    progress.step_index = 0
    progress.latents = progress.clean = None
    progress.sink_latents = list(oldest.sink_latents)
    progress.window_latents = deque(oldest.window_latents)
    progress.block_input, progress.first_step = oldest.block_input, oldest.first_step
    restore(decode_state, oldest.decode_state)
    if audio_state is not None and oldest.audio_state is not None:
        restore(audio_state, oldest.audio_state)
    return oldest
