"""A runnable KServe v2 server for one model repository (HTTP + gRPC).

    python -m kiln.serving.server --model-repository DIR \
        --host 127.0.0.1 --http-port 8000 --grpc-port 8001

Models load before the ports open (like Triton); a model that fails to load
is reported and the others still serve. SIGINT/SIGTERM drain in-flight
requests, then unload every model.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kiln.frontends.kserve.http import add_kserve_routes
from kiln.serving.codecs.limits import Limits
from kiln.serving.dataplane import DataPlane, DataPlaneOptions

log = logging.getLogger("kiln.serving")


@dataclass(frozen=True)
class ServeOptions:
    model_repository: str
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001  # < 0 disables gRPC
    max_body_bytes: int = 64 << 20
    strict_readiness: bool = True
    log_level: str = "info"


def build_app(dataplane: DataPlane, metrics_route: bool = True) -> FastAPI:
    app = FastAPI(title="Kiln model serving", docs_url=None, redoc_url=None, openapi_url=None)
    add_kserve_routes(app, dataplane)
    if metrics_route:
        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(dataplane.metrics.registry), media_type=CONTENT_TYPE_LATEST)
    return app


async def serve(options: ServeOptions) -> None:
    import uvicorn

    from kiln.frontends.kserve.grpc.servicer import start_grpc_server

    dataplane = DataPlane.for_repository(
        options.model_repository,
        options=DataPlaneOptions(Limits(max_body_bytes=options.max_body_bytes), options.strict_readiness),
    )
    errors = await dataplane.start()
    for name, message in errors.items():
        log.error("model %s is unavailable: %s", name, message)
    grpc_server = None
    if options.grpc_port >= 0:
        grpc_server = await start_grpc_server(dataplane, options.host, options.grpc_port)
        log.info("KServe v2 gRPC on %s:%d", options.host, grpc_server.bound_port)
    config = uvicorn.Config(build_app(dataplane), host=options.host, port=options.http_port,
                            log_level=options.log_level, lifespan="off", access_log=False)
    try:
        await uvicorn.Server(config).serve()
    finally:
        if grpc_server is not None:
            await grpc_server.stop(grace=5)
        await dataplane.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-repository", required=True, help="directory of <model>/config.yaml + versions")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001, help="-1 disables gRPC")
    parser.add_argument("--max-body-bytes", type=int, default=64 << 20)
    parser.add_argument("--no-strict-readiness", action="store_true",
                        help="report ready even if some models failed to load")
    parser.add_argument("--log-level", default="info")


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    return ServeOptions(
        model_repository=args.model_repository, host=args.host, http_port=args.http_port,
        grpc_port=args.grpc_port, max_body_bytes=args.max_body_bytes,
        strict_readiness=not args.no_strict_readiness, log_level=args.log_level,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kiln.serving.server")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = options_from_args(args)
    Limits(max_body_bytes=options.max_body_bytes)  # refuse a bad limit before loading anything
    asyncio.run(serve(options))


if __name__ == "__main__":
    main()
