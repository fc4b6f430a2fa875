"""The engine loop: one AR block per tick for every scheduled session, device work on one thread.

The event loop plans a tick, hands the plan to the device thread, and awaits
it without blocking; results go into per-session bounded queues with
``put_nowait`` (the scheduler only runs sessions that have room), so no client
can stall a tick.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from engine.runner import StepResult

if TYPE_CHECKING:
    from engine.api import Engine

log = logging.getLogger("arstream.loop")

IDLE_POLL_S = 1.0  # upper bound on a sleep, so timeouts are enforced without a tick


class EngineLoop:
    def __init__(self, engine: "Engine", executor: ThreadPoolExecutor) -> None:
        self.engine = engine
        self.executor = executor
        self.wake = asyncio.Event()
        self.ticks = 0
        self._stopping = False
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="arstream-engine-loop")

    async def stop(self) -> None:
        self._stopping = True
        self.wake.set()
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        while not self._stopping:
            engine.enforce_limits()
            plan = engine.next_plan()
            if plan.empty:
                timeout = min(engine.scheduler.next_wakeup(engine.open_sessions(), time.monotonic()), IDLE_POLL_S)
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout=None if math.isinf(timeout) else timeout)
                except TimeoutError:
                    pass
                continue
            try:
                result: StepResult = await loop.run_in_executor(self.executor, engine.runner.execute, plan)
            except Exception as error:  # the runner itself broke: nothing can be trusted
                log.exception("runner crashed")
                result = StepResult(fatal=f"runner crashed: {error!r}")
            self.ticks += 1
            engine.apply_result(result)
            if result.fatal is not None:
                return
