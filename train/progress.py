"""A training stage's progress: the loss log it writes and the clock that ends it."""

from __future__ import annotations

import time
from pathlib import Path


class LossLog:
    """Appends one line per logged step: ``stage step seconds name=value ...`` (flushed at once)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.start = time.monotonic()
        self.last: dict[str, dict[str, float]] = {}

    def write(self, stage: str, step: int, **values: float) -> None:
        self.last[stage] = {"step": step, **values}
        fields = " ".join(f"{k}={v:.5f}" for k, v in values.items())
        line = f"{stage} step={step} t={time.monotonic() - self.start:.1f}s {fields}"
        print(line, flush=True)
        with self.path.open("a") as handle:
            handle.write(line + "\n")


class StageClock:
    """A stage's time budget: ``expired`` once ``seconds`` have passed (or ``max_steps`` were taken)."""

    def __init__(self, seconds: float, max_steps: int | None = None) -> None:
        self.deadline = time.monotonic() + seconds
        self.max_steps = max_steps

    def expired(self, step: int) -> bool:
        return time.monotonic() >= self.deadline or (self.max_steps is not None and step >= self.max_steps)
