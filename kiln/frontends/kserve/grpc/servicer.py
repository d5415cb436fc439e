"""`inference.GRPCInferenceService` on grpc.aio, over the DataPlane.

A KilnError aborts the call with the error's gRPC status code (from
kiln/errors.py). On ModelStreamInfer every request in the stream is answered
(one response, or several when the model streams it) or gets exactly one
response with `error_message`, whatever the error, and the stream goes on.
A cancelled call cancels its requests. With an API key every call but the
health ones needs it (auth.py); with a certificate the port speaks TLS only.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
from google.protobuf import json_format

from kiln.dataplane.dataplane import DataPlane
from kiln.dataplane.routed import TARGET_PARAMETER
from kiln.errors import InvalidRequestError, KilnError
from kiln.frontends.kserve import documents
from kiln.frontends.kserve.grpc.auth import HEALTH_METHODS, ApiKeyInterceptor
from kiln.frontends.kserve.grpc.codec import decode_request, encode_response, param_value
from kiln.frontends.kserve.grpc.stubs import load_stubs
from kiln.frontends.routing import TARGET_HEADER, route_key

log = logging.getLogger("kiln.kserve.grpc")
IDLE_CONNECTION_MS = 5 * 60 * 1000  # a connection with no call for this long is closed (GOAWAY)


def _guard(method):
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except KilnError as exc:
            target = () if exc.route_target is None else ((TARGET_HEADER, exc.route_target),)
            await context.abort(grpc.StatusCode[exc.grpc_code], exc.message, trailing_metadata=target)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - never leak internals
            log.exception("unexpected error in %s", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")

    wrapper.__name__ = method.__name__
    return wrapper


def make_servicer(dataplane: DataPlane):
    pb2, pb2_grpc = load_stubs()

    base: Any = pb2_grpc.GRPCInferenceServiceServicer  # generated at run time (stubs.py)

    class Servicer(base):
        @_guard
        async def ServerLive(self, request, context):
            return pb2.ServerLiveResponse(live=dataplane.live())

        @_guard
        async def ServerReady(self, request, context):
            return pb2.ServerReadyResponse(ready=dataplane.ready())

        @_guard
        async def ModelReady(self, request, context):
            return pb2.ModelReadyResponse(ready=dataplane.model_ready(request.name, request.version))

        @_guard
        async def ServerMetadata(self, request, context):
            return pb2.ServerMetadataResponse(**documents.server_metadata())

        @_guard
        async def ModelMetadata(self, request, context):
            config = dataplane.model_config(request.name, request.version)
            doc = documents.model_metadata(config, dataplane.model_versions(request.name))
            return json_format.ParseDict(doc, pb2.ModelMetadataResponse())

        @_guard
        async def ModelInfer(self, request, context):
            key = _route_key(context)
            response = await dataplane.infer(decode_request(request, dataplane.limits), route_key=key)
            target = response.parameters.get(TARGET_PARAMETER)
            if target is not None:
                context.set_trailing_metadata(((TARGET_HEADER, str(target)),))
            return encode_response(pb2, response)

        async def ModelStreamInfer(self, request_iterator, context):
            results: asyncio.Queue = asyncio.Queue()
            pending: set[asyncio.Task] = set()
            key = _route_key(context)

            async def one(request):
                try:
                    decoded = decode_request(request, dataplane.limits)
                    async for response in dataplane.stream_infer(decoded, route_key=key):
                        await results.put(pb2.ModelStreamInferResponse(infer_response=encode_response(pb2, response)))
                except KilnError as exc:
                    await results.put(pb2.ModelStreamInferResponse(error_message=exc.message))
                except Exception as exc:  # noqa: BLE001 - the stream goes on; never leak internals
                    log.exception("unexpected error in ModelStreamInfer")
                    message = f"internal error: {type(exc).__name__}"
                    await results.put(pb2.ModelStreamInferResponse(error_message=message))

            async def reader():
                try:
                    async for request in request_iterator:
                        task = asyncio.ensure_future(one(request))
                        pending.add(task)
                        task.add_done_callback(pending.discard)
                    await asyncio.gather(*list(pending), return_exceptions=True)
                finally:
                    await results.put(None)

            read = asyncio.ensure_future(reader())
            try:
                while (item := await results.get()) is not None:
                    yield item
            finally:
                read.cancel()
                for task in list(pending):
                    task.cancel()

        @_guard
        async def ModelConfig(self, request, context):
            doc = documents.triton_config(dataplane.model_config(request.name, request.version))
            config = json_format.ParseDict(doc, pb2.ModelConfig(), ignore_unknown_fields=True)
            return pb2.ModelConfigResponse(config=config)

        @_guard
        async def ModelStatistics(self, request, context):
            doc = documents.statistics(dataplane.model_statistics(request.name, request.version))
            return json_format.ParseDict(doc, pb2.ModelStatisticsResponse(), ignore_unknown_fields=True)

        @_guard
        async def RepositoryIndex(self, request, context):
            rows = dataplane.repository_index(request.ready)
            return pb2.RepositoryIndexResponse(models=[pb2.RepositoryIndexResponse.ModelIndex(**r) for r in rows])

        @_guard
        async def RepositoryModelLoad(self, request, context):
            await dataplane.load_model(request.model_name, _repo_params(request))
            return pb2.RepositoryModelLoadResponse()

        @_guard
        async def RepositoryModelUnload(self, request, context):
            await dataplane.unload_model(request.model_name, _repo_params(request))
            return pb2.RepositoryModelUnloadResponse()

    return Servicer()


def _route_key(context) -> str | None:
    metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
    return route_key(metadata)


def _repo_params(request) -> dict:
    params = {k: param_value(v) for k, v in request.parameters.items()}
    if any(isinstance(v, bytes) for k, v in params.items() if not k.startswith("file:")):
        raise InvalidRequestError("repository parameters must not be bytes")
    return params


async def start_grpc_server(dataplane: DataPlane, host: str = "127.0.0.1", port: int = 8001) -> grpc.aio.Server:
    """Start the KServe v2 gRPC server on the running loop and return it.
    The caller stops it with `await server.stop(grace)`."""
    _, pb2_grpc = load_stubs()
    config = dataplane.config
    size = dataplane.limits.max_body_bytes
    interceptors = []
    if config.api_key:
        open_methods = frozenset() if config.protect_health else HEALTH_METHODS
        interceptors.append(ApiKeyInterceptor(config.api_key, open_methods))
    server = grpc.aio.server(interceptors=interceptors, options=[
        ("grpc.max_receive_message_length", size),
        ("grpc.max_send_message_length", size),
        ("grpc.max_metadata_size", config.max_header_bytes),
        ("grpc.max_connection_idle_ms", IDLE_CONNECTION_MS),
    ])
    pb2_grpc.add_GRPCInferenceServiceServicer_to_server(make_servicer(dataplane), server)
    if config.ssl_certfile and config.ssl_keyfile:
        credentials = grpc.ssl_server_credentials([(_read(config.ssl_keyfile), _read(config.ssl_certfile))])
        bound = server.add_secure_port(f"{host}:{port}", credentials)
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the gRPC server to {host}:{port}")
    server.bound_port = bound
    await server.start()
    return server


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
