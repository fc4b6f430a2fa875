"""The engine loop: calls the core's ``step()`` while there is work, sleeps until woken otherwise.

The core's step plans a tick, hands the plan to the device thread and awaits
it without blocking; results go into per-session one-chunk queues with
``put_nowait`` (the scheduler only runs sessions that have room), so no client
can stall a tick.
"""

from __future__ import annotations

import asyncio
import logging
import math

from engine.core import EngineCore

log = logging.getLogger("arstream.loop")

IDLE_POLL_S = 1.0  # upper bound on a sleep, so timeouts are enforced without a tick


class EngineLoop:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._stopping = False
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="arstream-engine-loop")

    async def stop(self) -> None:
        self._stopping = True
        self.core.wake.set()
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        core = self.core
        while not self._stopping and core.alive:
            if await core.step():
                continue
            # No await between an idle step and clearing the event: a control submitted meanwhile is not lost.
            timeout = min(core.next_wakeup(), IDLE_POLL_S)
            core.wake.clear()
            try:
                await asyncio.wait_for(core.wake.wait(), timeout=None if math.isinf(timeout) else timeout)
            except TimeoutError:
                pass
