"""The one object that crosses from the scheduler to the runner, and the kinds of control it carries."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# The controls a work item may run besides its block, costliest first. A work's control time is learned for
# its costliest kind; the kinds that re-run forwards are counted by the scheduler (about a block each until
# their cost is learned), opening a session and a soft prompt change are not.
CONTROL_KINDS = ("recache", "reset", "open", "soft")
FORWARD_CONTROL_KINDS = ("recache", "reset")


@dataclass(frozen=True)
class InputContext:
    """What a session's content starts from: ``frames`` (uint8 ``[T, H, W, 3]``, ``T = 1 + 4 (n - 1)``: an image
    is one frame, a clip's last window more), or ``None``: the prompt alone."""

    frames: np.ndarray | None = field(default=None, compare=False)


@dataclass(frozen=True)
class OpenSession:
    """A session the runner has not seen: create its device state (from ``context`` frames, when given)."""

    seed: int
    prompt: str
    negative_prompt: str
    context: np.ndarray | None = field(default=None, compare=False)


@dataclass(frozen=True)
class LiveFrames:
    """Live input offered to a session's next block, oldest first: the runner takes the frames the block needs
    (and says how many, so the core drops exactly those); ``first_seq`` numbers ``frames[0]`` in the buffer,
    ``numbers`` are the frames' own (their place among the live frames the session received: chunks name them)."""

    first_step: int  # the schedule step the block starts at (the pipeline's first_step_for(strength))
    frames: tuple[np.ndarray, ...] = field(compare=False)
    first_seq: int
    numbers: tuple[int | None, ...] = ()  # one per frame (None: not numbered)


@dataclass(frozen=True)
class PromptUpdate:
    """A prompt change waiting for the device (the session record holds it until a plan carries it)."""

    prompt: str
    negative_prompt: str
    policy: str  # soft | recache | reset


@dataclass(frozen=True)
class Rewind:
    """Take the session back to the start of its block ``block`` (its content's block index) and make it again,
    the frames of its first ``skip_latents`` latent frames not sent (the viewer has the old block's): supersede,
    ``engine/undo.py``."""

    block: int
    skip_latents: int
    skip_frames: int = 0  # of the next latent frame's frames, those the viewer has too: made, not sent (a cut
    # inside a piece)


@dataclass(frozen=True)
class SessionWork:
    """What to do for one session this tick, in this order: (rewind), open, reset, prompt, run."""

    session_id: str
    open: OpenSession | None = None
    reset: bool = False
    reset_context: InputContext | None = None  # with reset: what the content restarts from; None: as it started
    # With a reset (or a prompt change with policy reset): the old content's unreleased media was cut from the
    # stream, so its held-back audio is dropped instead of flushed into the new content's first chunk.
    cut: bool = False
    rewind: Rewind | None = None  # before anything else: take back the blocks from this one on
    settled_before: int | None = None  # no block before this one (content block index) will be taken back
    prompt: PromptUpdate | None = None
    run: bool = False
    live: LiveFrames | None = None  # with run: live input for the block, if it begins one

    @property
    def control_kinds(self) -> tuple[str, ...]:
        """The controls this work runs, costliest first (a prompt change with policy ``reset`` is a reset)."""
        ran = {self.prompt.policy} if self.prompt is not None else set()
        if self.open is not None:
            ran.add("open")
        if self.reset:
            ran.add("reset")
        return tuple(kind for kind in CONTROL_KINDS if kind in ran)

    @property
    def plain_block(self) -> bool:
        """A block and nothing else (no control, no rewind, no live input): the work sessions may share one
        batched forward for (``batch_sessions``, engine/runner.py)."""
        return self.run and not self.control_kinds and self.rewind is None and self.live is None


@dataclass(frozen=True)
class FinishedSession:
    session_id: str
    reason: str


@dataclass(frozen=True)
class StepPlan:
    """Sessions to release first (their ids are finished), then per-session work in fair order."""

    finished: list[FinishedSession] = field(default_factory=list)
    work: list[SessionWork] = field(default_factory=list)
    planned_at: float = 0.0  # epoch ms

    @property
    def empty(self) -> bool:
        return not self.finished and not self.work
