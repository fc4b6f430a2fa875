"""Session controls as events, and the one state machine they drive.

A control is validated when it is submitted (so the caller gets its error at
once) and applied by the engine core at the next tick, in submission order.
Validation runs the transition on the state the session will have once its
already queued controls apply, so ``start`` then ``pause`` in one breath is
valid even though neither has been applied yet::

    created ──start──▶ active ◀──resume── paused
       │                 │ ──pause──────▶   │
       └──────── close / ending ────────────┴──▶ closed

``prompt``, ``reset``, ``pause`` and ``resume`` need a started session; every
control but ``close`` and ``detach`` needs an open one. ``detached`` and
``draining`` are not states of this machine: they are how the protocol shows
an open session without a socket, or while the engine drains.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

import numpy as np

from engine.errors import AlreadyStarted, NotStarted, SessionClosed
from engine.plan import InputContext
from engine.session import ControlMark


class SessionState(str, Enum):
    CREATED = "created"
    ACTIVE = "active"
    PAUSED = "paused"
    CLOSED = "closed"


@dataclass(frozen=True)
class Start:
    prompt: str
    seed: int | None = None
    negative_prompt: str | None = None
    pace: bool | None = None
    context: np.ndarray | None = field(default=None, compare=False)  # an image's or clip's frames to start from


@dataclass(frozen=True)
class SetPrompt:
    prompt: str
    negative_prompt: str | None
    policy: str  # soft | recache | reset
    mark: ControlMark | None = field(default=None, compare=False)  # followed to the first frames showing it


@dataclass(frozen=True)
class Pause:
    pass


@dataclass(frozen=True)
class Resume:
    pass


@dataclass(frozen=True)
class Reset:
    context: InputContext | None = None  # what the content restarts from; None: what it started from
    mark: ControlMark | None = field(default=None, compare=False)  # followed to the first frames showing it


@dataclass(frozen=True)
class Close:
    reason: str = "client"


@dataclass(frozen=True)
class Attach:
    # The new viewer's jitter margin (``EngineConfig.playout_margin_s`` when None): a peer whose track paces the
    # frames in this process needs less than a player across the network.
    margin_s: float | None = None


@dataclass(frozen=True)
class Detach:
    pass


Control = Start | SetPrompt | Pause | Resume | Reset | Close | Attach | Detach


@dataclass(frozen=True)
class SessionView:
    """What controls read and change of a session: its state, its consumer, its conditioning."""

    state: SessionState
    attached: bool
    detached: bool  # open without a consumer, waiting for one to (re)attach
    prompt: str | None
    negative_prompt: str
    seed: int
    pace: bool


def applied(view: SessionView, control: Control, *, starts_on_attach: bool = False) -> SessionView:
    """The session as ``control`` leaves it, or the protocol's error for a control its state refuses.

    The one statement of what a control changes: checking a control against the queued ones, the
    snapshots (both fold the queue over the session) and the core's apply at the tick all read it here.
    """
    view = replace(view, state=next_state(view.state, control, starts_on_attach=starts_on_attach))
    if isinstance(control, Start):
        return replace(
            view,
            prompt=control.prompt,
            seed=view.seed if control.seed is None else control.seed,
            pace=view.pace if control.pace is None else control.pace,
            negative_prompt=view.negative_prompt if control.negative_prompt is None else control.negative_prompt,
        )
    if isinstance(control, SetPrompt):
        negative = view.negative_prompt if control.negative_prompt is None else control.negative_prompt
        return replace(view, prompt=control.prompt, negative_prompt=negative)
    if isinstance(control, Attach):
        return replace(view, attached=True, detached=False)
    if isinstance(control, Detach):
        return replace(view, attached=False, detached=True)
    return view


def next_state(state: SessionState, control: Control, *, starts_on_attach: bool = False) -> SessionState:
    """The state after ``control``, or the protocol's error for a control this state refuses."""
    if state is SessionState.CLOSED:
        if isinstance(control, (Close, Detach)):
            return state
        raise SessionClosed("session is closed")
    if isinstance(control, Close):
        return SessionState.CLOSED
    if isinstance(control, (Attach, Detach)):
        if isinstance(control, Attach) and starts_on_attach and state is SessionState.CREATED:
            return SessionState.ACTIVE
        return state
    if isinstance(control, Start):
        if state is not SessionState.CREATED:
            raise AlreadyStarted("the session is already running")
        return SessionState.ACTIVE
    if state is SessionState.CREATED:
        raise NotStarted(f"send start before {_name(control)}")
    if isinstance(control, Pause):
        return SessionState.PAUSED
    if isinstance(control, Resume):
        return SessionState.ACTIVE
    return state  # SetPrompt, Reset: the state is unchanged


def _name(control: Control) -> str:
    return {SetPrompt: "changing the prompt", Pause: "pause", Resume: "resume", Reset: "reset"}[type(control)]
