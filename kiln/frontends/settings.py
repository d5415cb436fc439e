"""Server options (everything not about the engine), validated once.

The CLI derives one flag per field, as it does for EngineConfig.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import ConfigError

ENGINE_MODES = ("process", "thread")


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # Bearer token for everything but /health, /metrics, /version
    served_model_name: str | None = None  # default: the model file or directory name
    engine_mode: str = "process"  # "process": engine core in its own process; "thread": in this one
    max_queued_requests: int | None = None  # requests without a first token yet; None = unbounded
    max_request_bytes: int = 2 * 2**20
    max_n: int = 16
    max_tokens_limit: int | None = None  # None = only the context length limits max_tokens
    shutdown_timeout: int = 30  # seconds in-flight requests get to finish on SIGTERM
    log_level: str = "info"
    model_repository: str | None = None  # also serve this KServe v2 model repository
    grpc_port: int = 8001  # KServe v2 gRPC port when a repository is served; -1 = no gRPC

    def __post_init__(self) -> None:
        if not -1 <= self.grpc_port <= 65535:
            raise ConfigError(f"grpc_port must be in [-1, 65535], got {self.grpc_port}", param="grpc_port")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}", param="port")
        if self.engine_mode not in ENGINE_MODES:
            raise ConfigError(f"engine_mode must be one of {ENGINE_MODES}", param="engine_mode")
        if self.api_key == "":
            raise ConfigError("api_key must not be empty", param="api_key")
        for name in ("max_queued_requests", "max_tokens_limit"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{name} must be non-negative", param=name)
        for name in ("max_request_bytes", "max_n"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive", param=name)
        if self.shutdown_timeout < 0:
            raise ConfigError("shutdown_timeout must be non-negative", param="shutdown_timeout")
