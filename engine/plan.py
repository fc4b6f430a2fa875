"""The one object that crosses from the scheduler to the runner."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class OpenSession:
    """A session the runner has not seen: create its device state."""

    seed: int
    prompt: str
    negative_prompt: str


@dataclass(frozen=True)
class PromptUpdate:
    prompt: str
    negative_prompt: str
    policy: str  # soft | recache | reset


@dataclass(frozen=True)
class SessionWork:
    """What to do for one session this tick, in this order: open, reset, prompt, run."""

    session_id: str
    open: OpenSession | None = None
    reset: bool = False
    prompt: PromptUpdate | None = None
    run: bool = False


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
