"""The Ray Serve application: one front end (the ingress) in front of one worker deployment per GPU.

    serve run app.cluster.ray_app:build_app workers=2          # or: serve run deploy/ray/serve_config.yaml

    client ─WS/HTTP─▶ Serve HTTP proxy ─▶ ingress replica (the front end: placement, table, relay)
                                              │ WS/HTTP to the worker's base_url, X-Arstream-Internal
                                              ├──▶ ray-gpu-0  (worker deployment, 1 replica, num_gpus=1)
                                              └──▶ ray-gpu-1  ...

The ingress serves the same FastAPI front end as ``arstream serve --devices`` (``app/cluster/server.py``),
with :class:`~app.cluster.ray_pool.RayWorkerPool` as its pool: each new session goes to the worker with the
most headroom by the workers' own ``/internal/capacity`` and stays there; REST and re-attach for its id go
to the worker that admitted it; a full cluster refuses exactly as a full single server does (503
``capacity`` + ``Retry-After``; ``closed`` ``capacity`` + ``retry_after_s`` + close 1013).

The ingress has one replica: the session table is in its memory (docs/SCALE_OUT_RAY.md says what that
costs and what sharing it would take). It takes one request per open socket, so its
``max_ongoing_requests`` must exceed the sockets it may hold (Ray Serve's default is 5).
"""

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr
from ray import serve
from ray.serve import Application

from app.cluster.ray_pool import RayPoolLimits, RayWorkerPool
from app.cluster.ray_worker import ArstreamWorker, log_to_stderr

APP_NAME = "arstream"
INGRESS_NAME = "arstream-ingress"


class RayAppArgs(BaseModel):
    """``build_app``'s arguments (``serve run ... key=value``, or ``args:`` in a Serve config file)."""

    model_config = ConfigDict(extra="forbid")

    workers: int | list[dict[str, Any]] = Field(
        default=1,
        description="how many worker deployments (one per GPU), each with worker_ray_actor_options; or one "
                    "ray_actor_options dict per worker, to place each explicitly (custom resources)",
    )
    worker_ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_gpus": 1, "num_cpus": 2})
    ingress_ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 1})
    settings: dict[str, Any] = Field(
        default_factory=dict,
        description="arstream Settings fields (engine nested) for the front end and every worker; ARSTREAM_* "
                    "variables in the replicas' environment apply too (the token: ARSTREAM_TOKEN only)",
    )
    max_ongoing_requests: int = Field(default=1000, ge=1, description="ingress: open sockets + REST calls in flight")
    health_check_period_s: float = Field(default=5.0, gt=0)
    health_check_timeout_s: float = Field(default=10.0, gt=0)
    graceful_shutdown_timeout_s: float = Field(default=20.0, gt=0, description="a worker's drain, within Serve's stop")
    poll_interval_s: float = Field(default=0.5, gt=0, description="how often the pool looks at each worker")
    secret: SecretStr | None = Field(
        default=None, description="the ingress's key to its workers; default: a new random one per build"
    )


@serve.ingress()
class ArstreamIngress:
    """The front end as the Serve ingress; its app is built once the replica has its worker handles."""

    def __init__(self, workers: Mapping[str, Any], settings_fields: dict, secret: str, limits: RayPoolLimits) -> None:
        self.settings = front_end_settings(settings_fields)
        log_to_stderr(self.settings.log_format)
        self.secret = secret
        self.pool = RayWorkerPool(workers, limits)

    def __serve_build_asgi_app__(self):
        from app.cluster.server import create_frontend_app

        return create_frontend_app(self.settings, self.pool, self.secret)


def front_end_settings(fields: dict):
    """The front end's settings: the given ones without the engine's. The ingress runs no engine, and may run
    where the workers' device and model directory do not exist (a head node without a GPU), so the engine
    part is checked by each worker, where it runs (its replica fails with the reason)."""
    from app.settings import Settings
    from engine.config import EngineConfig

    return Settings(**{**fields, "engine": EngineConfig(), "worker": None})


def _check_engine_field_names(fields: dict) -> None:
    from engine.config import EngineConfig

    unknown = sorted(set(fields.get("engine") or {}) - set(EngineConfig.model_fields))
    if unknown:
        raise ValueError(f"settings.engine: unknown field(s) {', '.join(unknown)}")


def worker_names(args: RayAppArgs) -> list[str]:
    """Stable names for the workers' places: ``ray-gpu-N`` for GPU workers, ``ray-cpu-N`` otherwise."""
    options = _worker_options(args)
    return [f"ray-{'gpu' if option.get('num_gpus') else 'cpu'}-{index}" for index, option in enumerate(options)]


def _worker_options(args: RayAppArgs) -> list[dict[str, Any]]:
    if isinstance(args.workers, int):
        return [dict(args.worker_ray_actor_options) for _ in range(args.workers)]
    return [dict(option) for option in args.workers]


def build_app(args: dict | RayAppArgs) -> Application:
    """The application ``serve run``/``serve deploy`` builds. A bad argument or service setting, or an unknown
    engine field, fails here, before any replica starts; engine values are checked by each worker."""
    from app.cluster.frontend import new_internal_secret

    args = args if isinstance(args, RayAppArgs) else RayAppArgs.model_validate(args)
    if not _worker_options(args):
        raise ValueError("workers: at least one")
    if "token" in args.settings:  # a Serve config is shown by the dashboard and kept in the GCS
        raise ValueError("settings.token: set ARSTREAM_TOKEN in the replicas' environment (a Secret) instead")
    front_end_settings(args.settings)
    _check_engine_field_names(args.settings)
    secret = args.secret.get_secret_value() if args.secret is not None else new_internal_secret()
    worker_deployment = serve.deployment(ArstreamWorker)
    workers = {
        name: worker_deployment.options(
            name=name,
            num_replicas=1,
            ray_actor_options=options,
            health_check_period_s=args.health_check_period_s,
            health_check_timeout_s=args.health_check_timeout_s,
            graceful_shutdown_timeout_s=args.graceful_shutdown_timeout_s,
        ).bind(name, args.settings, secret)
        for name, options in zip(worker_names(args), _worker_options(args))
    }
    limits = RayPoolLimits(poll_interval_s=args.poll_interval_s)
    ingress = serve.deployment(ArstreamIngress).options(
        name=INGRESS_NAME,
        num_replicas=1,
        max_ongoing_requests=args.max_ongoing_requests,
        max_queued_requests=-1,
        ray_actor_options=dict(args.ingress_ray_actor_options),
        graceful_shutdown_timeout_s=args.graceful_shutdown_timeout_s + 5.0,
    )
    return ingress.bind(workers, args.settings, secret, limits)
