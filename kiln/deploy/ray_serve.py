"""Kiln on Ray Serve: every replica is a whole Kiln server process (one
DataPlane with its LLM engines and repository models, and the HTTP app of
`kiln.server.app.build_app`) behind Ray Serve's HTTP proxy, so the OpenAI
and KServe v2 HTTP routes, streaming included, answer on Ray's port as they
do on `kiln serve`'s.

    kiln serve MODEL --ray --ray-max-replicas 4            # a local Ray cluster, or --ray-address
    serve run kiln.deploy.ray_serve:build model=MODEL ray_max_replicas=4

Ray Serve routes each request to the less loaded of two sampled replicas
(its default power-of-two-choices router) and scales the replicas between
the minimum and the maximum on ongoing requests per replica, or on the sum
of the replicas' kiln:desired_replicas (`--ray-autoscaling-policy
kiln-hint`). A replica loads its models before Ray sends it traffic, drains
(Ray stops routing to it, then waits up to `shutdown_timeout` for its
requests) before it stops, and is replaced when its health check fails (an
engine died). KServe v2 gRPC is off inside replicas (Ray's proxy carries
HTTP; several replicas on one node would contend for one gRPC port).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import typing
from typing import Any, cast

from ray import serve
from ray.serve import Application, Deployment
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.config import EngineConfig, ServerConfig
from kiln.deploy.ray_config import HINT_METRIC, RayServeConfig, deployment_options, typed_options
from kiln.errors import ConfigError
from kiln.server.app import build_app
from kiln.server.compose import build_dataplane

log = logging.getLogger(__name__)

ENGINE_SECTIONS = tuple(typing.get_type_hints(EngineConfig).values())  # ModelConfig, CacheConfig, ...
REPLICA_HEADER = "x-kiln-replica"  # which replica answered (logs, debugging, tests)


@serve.ingress()
class KilnReplica:
    """One Kiln server inside a Ray Serve replica."""

    async def __init__(self, server: ServerConfig, llm: EngineConfig | None):  # type: ignore[misc]  # Ray awaits it
        self.dataplane = build_dataplane(dataclasses.replace(server, grpc_port=-1), llm)
        errors = await self.dataplane.start()
        fatal = [f"{name}: {errors[name]}" for name in self.dataplane.command_line_models if name in errors]
        if fatal:
            await self.dataplane.shutdown()
            raise RuntimeError(f"model failed to load: {fatal[0]}")  # Ray retries the replica
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    def __serve_build_asgi_app__(self) -> ASGIApp:
        return ReplicaHeader(build_app(self.dataplane), self.replica_id)

    async def check_health(self) -> None:
        """Ray replaces a replica whose check fails: here, one whose engine died."""
        dead = [name for name, state in self.dataplane.model_states().items() if state == "dead"]
        if dead:
            raise RuntimeError(f"engine of {dead} died")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """For the kiln-hint policy: this replica's desired replicas, summed over its models."""
        return {HINT_METRIC: float(sum(self.dataplane.autoscale.desired_replicas().values()))}


class ReplicaHeader:
    """ASGI middleware: every HTTP response names the replica that made it."""

    def __init__(self, app: ASGIApp, replica_id: str):
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica_id.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


def application(server: ServerConfig, llm: EngineConfig | None, ray: RayServeConfig) -> Application:
    """The Ray Serve application of Kiln replicas (deploy it with `serve.run`)."""
    world_size = llm.parallel.world_size if llm is not None else 1
    deployment = cast(Deployment, serve.deployment(KilnReplica))  # the ingress decorator hides the class from mypy
    deployment = deployment.options(name="kiln", **deployment_options(ray, server, world_size))
    return deployment.bind(server, llm)


def build(args: dict[str, Any]) -> Application:
    """`serve run kiln.deploy.ray_serve:build key=value ...`: keys are `kiln serve`'s
    options with underscores (model=..., model_repository=..., ray_max_replicas=...)."""
    engine_keys = {f.name for section in ENGINE_SECTIONS for f in dataclasses.fields(section)}
    known = {f.name for f in dataclasses.fields(ServerConfig)} | {f.name for f in dataclasses.fields(RayServeConfig)}
    unknown = set(args) - known - engine_keys
    if unknown:
        raise ConfigError(f"unknown option(s) {sorted(unknown)}")
    server = ServerConfig(**typed_options(ServerConfig, args))
    ray = RayServeConfig(**typed_options(RayServeConfig, args))
    engine_args = {k: v for k, v in args.items() if k in engine_keys}
    llm = None
    if "model" in args or server.model_repository is None:
        llm = EngineConfig.from_flat(**_typed_engine_options(engine_args))
    return application(server, llm, ray)


def _typed_engine_options(args: dict[str, Any]) -> dict[str, Any]:
    typed: dict[str, Any] = {}
    for section in ENGINE_SECTIONS:
        typed |= typed_options(section, args)
    return typed


def run(server: ServerConfig, llm: EngineConfig | None, ray: RayServeConfig) -> int:
    """`kiln serve --ray`: deploy on Ray Serve (its proxy on --host/--port) and
    block until SIGTERM/SIGINT, then delete the application (replicas drain)."""
    import os

    import ray as ray_core

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a cluster Kiln starts reports nothing outside
    ray_core.init(address=ray.ray_address, include_dashboard=False)
    # After ray.init, which installs its own SIGTERM handler; a signal while the
    # application deploys deletes it once deployed.
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve.start(http_options={"host": server.host, "port": server.port})
        serve.run(application(server, llm, ray), name=ray.ray_app_name, route_prefix=ray.ray_route_prefix)
        log.info("Kiln on Ray Serve at http://%s:%d%s", server.host, server.port, ray.ray_route_prefix)
        stop.wait()
        log.info("stopping: deleting application %s (its replicas drain)", ray.ray_app_name)
        serve.delete(ray.ray_app_name)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        ray_core.shutdown()
    return 0
