"""The API key on gRPC: metadata `authorization: Bearer <key>`, checked before
any handler runs (the same constant-time check as HTTP, kiln/frontends/auth.py).

The server health calls (ServerLive, ServerReady) stay open like HTTP's
/v2/health routes, unless the server runs with --protect-health. ModelReady
names a model, so, like HTTP's /v2/models/{name}/ready, it needs the key: an
anonymous caller cannot probe which models the server holds.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from kiln.frontends.auth import UNAUTHORIZED, bearer_matches

SERVICE = "/inference.GRPCInferenceService/"
HEALTH_METHODS = frozenset(SERVICE + m for m in ("ServerLive", "ServerReady"))


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str, open_methods: frozenset[str] = HEALTH_METHODS):
        self.key = api_key.encode()
        self.open_methods = open_methods

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method in self.open_methods or self._authorized(details):
            return handler
        return _refusing(handler)

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        for name, value in details.invocation_metadata or ():
            if name == "authorization":
                header = value if isinstance(value, bytes) else value.encode()
                return bearer_matches(header, self.key)
        return False


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape that answers UNAUTHENTICATED."""

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHORIZED)

    async def streaming(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHORIZED)
        yield  # pragma: no cover - makes this an async generator, as a streaming handler must be

    codec = {"request_deserializer": handler.request_deserializer,
             "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **codec)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **codec)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **codec)
    return grpc.unary_unary_rpc_method_handler(unary, **codec)
