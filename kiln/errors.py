"""Kiln's typed errors. Every user-facing failure is one of these.

The mapping from error type to HTTP / gRPC status lives here and nowhere
else, so every transport answers the same failure the same way.
"""
from __future__ import annotations


class KilnError(Exception):
    """Base class. `http_status` and `grpc_code` are class attributes."""

    http_status = 500
    grpc_code = "INTERNAL"
    error_type = "internal_error"
    # The route target a routed request failed on (set by the route's call): the error
    # answer names it as the success answer does (x-kiln-route-target).
    route_target: str | None = None

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


def describe(exc: BaseException) -> str:
    """'Type: message' of any exception, even one whose __str__ raises (user code's can)."""
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - the message itself is broken
        text = "(its message could not be read)"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class InvalidRequestError(KilnError):
    """The request is malformed or a parameter is out of range."""

    http_status = 400
    grpc_code = "INVALID_ARGUMENT"
    error_type = "invalid_request_error"


class PromptTooLongError(InvalidRequestError):
    """Prompt plus requested output does not fit the model's context."""


class ConfigError(KilnError):
    """An engine or model option is invalid (a start-up error)."""

    http_status = 400
    grpc_code = "INVALID_ARGUMENT"
    error_type = "config_error"


class ModelLoadError(KilnError):
    """A model file is missing, corrupt or of an unsupported kind."""

    http_status = 500
    grpc_code = "INTERNAL"
    error_type = "model_load_error"


class ModelConfigLoadError(ModelLoadError):
    """A load failed because the model's config (or a load request's override) is
    invalid, e.g. an `llm` path outside the version directory: the client's to fix."""

    http_status = 400
    grpc_code = "INVALID_ARGUMENT"


class ModelNotFoundError(KilnError):
    http_status = 404
    grpc_code = "NOT_FOUND"
    error_type = "not_found_error"


class AuthenticationError(KilnError):
    http_status = 401
    grpc_code = "UNAUTHENTICATED"
    error_type = "authentication_error"


class ForbiddenError(KilnError):
    """The server is set up to refuse this operation (e.g. model control is off)."""

    http_status = 403
    grpc_code = "PERMISSION_DENIED"
    error_type = "permission_error"


class OverloadedError(KilnError):
    """The queue is full; the client should retry later."""

    http_status = 503
    grpc_code = "UNAVAILABLE"
    error_type = "overloaded_error"
    retry_after_s = 1


class EngineDeadError(KilnError):
    """The engine process died; the server cannot answer until restarted."""

    http_status = 503
    grpc_code = "UNAVAILABLE"
    error_type = "engine_dead_error"


class RequestFailedError(KilnError):
    """One request failed inside the engine (the engine and the other requests go on)."""

    http_status = 500
    grpc_code = "INTERNAL"
    error_type = "request_failed_error"


class ModelUnavailableError(KilnError):
    """The model exists but is not ready (loading, unloading or failed)."""

    http_status = 503
    grpc_code = "UNAVAILABLE"
    error_type = "unavailable_error"


class EngineRestartingError(ModelUnavailableError):
    """The engine died and a new one is starting; retry shortly."""

    error_type = "engine_restarting_error"
    retry_after_s = 2


class RequestTimeoutError(KilnError):
    """A queued request waited past its timeout and was removed unexecuted."""

    http_status = 503
    grpc_code = "UNAVAILABLE"
    error_type = "timeout_error"


class ModelLoadingError(ModelUnavailableError):
    """The model is still loading; retry shortly."""

    error_type = "model_loading_error"
    retry_after_s = 5


class DrainingError(KilnError):
    """The server is shutting down and takes no new requests."""

    http_status = 503
    grpc_code = "UNAVAILABLE"
    error_type = "server_draining_error"
    retry_after_s = 5
