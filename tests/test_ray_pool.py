"""RayWorkerPool's bookkeeping, without a Ray cluster: generations, and when a generation counts as lost.

The deployment handles are stand-ins that answer ``info()`` as a worker replica does (``app/cluster/ray_worker.py``);
the workers' ports are real listening sockets, so the pool's connect probe runs for real. The pool on a real
cluster, with Ray restarting a killed replica, is tests/test_ray_serve.py.
"""

from __future__ import annotations

import asyncio
import contextlib

from app.cluster.pool import WorkerEndpoint
from app.cluster.ray_pool import RayPoolLimits, RayWorkerPool
from app.cluster.ray_worker import WorkerInfo

FAST = RayPoolLimits(poll_interval_s=0.02, info_timeout_s=0.2, probe_timeout_s=0.2)


class FakeReplica:
    """What the pool reaches through a deployment handle: ``handle.info.remote()``, awaited."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.answer: WorkerInfo | None = None  # None: the call never answers (Ray is replacing the replica)
        self.info = self

    def remote(self):
        async def call():
            if self.answer is None:
                await asyncio.sleep(3600)
            return self.answer
        return call()

    def becomes(self, incarnation: str, port: int, *, engine_alive: bool = True) -> None:
        self.answer = WorkerInfo(self.name, f"http://127.0.0.1:{port}", incarnation, "node", 1, engine_alive, True)


async def _listening() -> asyncio.base_events.Server:
    return await asyncio.start_server(lambda reader, writer: writer.close(), "127.0.0.1", 0)


def _port(server) -> int:
    return server.sockets[0].getsockname()[1]


async def _settle() -> None:
    await asyncio.sleep(0.3)


@contextlib.asynccontextmanager
async def _started_pool(name: str):
    """One replica answering as incarnation "a" on a listening port, its pool started, losses recorded."""
    replica = FakeReplica(name)
    server = await _listening()
    replica.becomes("a", _port(server))
    pool = RayWorkerPool({name: replica}, FAST)
    lost: list[WorkerEndpoint] = []
    pool.on_worker_lost(lost.append)
    await pool.start()
    try:
        yield replica, server, pool, lost
    finally:
        await pool.stop()
        server.close()


def test_generations_count_incarnations_and_each_loss_is_reported_once():
    async def scenario():
        async with _started_pool("ray-cpu-0") as (replica, first, pool, lost):
            (endpoint,) = pool.endpoints()
            assert endpoint == WorkerEndpoint("ray-cpu-0", f"http://127.0.0.1:{_port(first)}", 1)

            replica.answer = None  # info() stops answering, the port still accepts: slow, not lost
            await _settle()
            assert pool.endpoints() == [endpoint] and lost == []

            first.close()  # the process died: its port refuses
            await first.wait_closed()
            await _settle()
            assert pool.endpoints() == [] and lost == [endpoint]

            second = await _listening()
            replica.becomes("b", _port(second))  # Ray's replacement answers
            await _settle()
            assert pool.endpoints() == [WorkerEndpoint("ray-cpu-0", f"http://127.0.0.1:{_port(second)}", 2)]

            third = await _listening()
            replica.becomes("c", _port(third))  # replaced again while the old port still listens
            await _settle()
            assert [e.generation for e in lost] == [1, 2] and pool.endpoints()[0].generation == 3
            second.close()
            third.close()

    asyncio.run(scenario())


def test_a_dead_engine_loses_its_generation_even_while_the_replica_still_answers():
    async def scenario():
        async with _started_pool("ray-gpu-0") as (replica, server, pool, lost):
            replica.becomes("a", _port(server), engine_alive=False)  # check_health fails from now on
            await _settle()
            assert pool.endpoints() == [] and [e.generation for e in lost] == [1]
            await _settle()
            assert len(lost) == 1  # that incarnation is never listed (nor lost) again
            replica.becomes("b", _port(server))
            await _settle()
            assert [e.generation for e in pool.endpoints()] == [2]

    asyncio.run(scenario())
