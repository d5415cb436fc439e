"""The KServe v2 data plane: one facade under both HTTP and gRPC.

Transports decode wire messages into `InferRequest`s, call these methods and
encode what comes back; every answer (and every error, as a KilnError)
comes from here, so both transports behave the same.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

import kiln
from kiln.errors import InvalidRequestError
from kiln.serving.backends.registry import PLATFORMS
from kiln.serving.codecs.limits import Limits
from kiln.serving.metrics import ServingMetrics
from kiln.serving.repository.config import ModelConfig, TensorSpec
from kiln.serving.repository.manager import ModelManager
from kiln.serving.types import InferRequest, InferResponse

EXTENSIONS = ["binary_data", "model_configuration", "model_repository", "statistics", "schedule_policy"]


@dataclass(frozen=True)
class DataPlaneOptions:
    limits: Limits = Limits()
    strict_readiness: bool = True  # server ready only if every model loaded


class DataPlane:
    def __init__(self, manager: ModelManager, options: DataPlaneOptions | None = None):
        self.manager = manager
        self.options = options or DataPlaneOptions()
        self.limits = self.options.limits
        self.started = False

    @classmethod
    def for_repository(cls, repository, metrics: ServingMetrics | None = None,
                       options: DataPlaneOptions | None = None) -> DataPlane:
        return cls(ModelManager(repository, metrics), options)

    @property
    def metrics(self) -> ServingMetrics:
        return self.manager.metrics

    async def start(self) -> dict[str, str]:
        """Load the repository; returns {model: error} for models that failed."""
        errors = await self.manager.load_all()
        self.started = True
        return errors

    async def stop(self) -> None:
        await self.manager.close()

    # ------------------------------------------------------------ health

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        if not self.started:
            return False
        return self.manager.all_ready() if self.options.strict_readiness else True

    def server_metadata(self) -> dict[str, Any]:
        return {"name": "kiln", "version": kiln.__version__, "extensions": list(EXTENSIONS)}

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            self.manager.resolve(name, version)
        except InvalidRequestError:
            raise
        except Exception:  # noqa: BLE001 - unknown or unavailable = not ready
            return False
        return True

    # ------------------------------------------------------------ metadata

    def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        loaded = self.manager.resolve(name, version)
        entry = self.manager.entry(name)
        config = loaded.config
        return {
            "name": name,
            "versions": [str(v) for v in sorted(entry.versions)],
            "platform": PLATFORMS.get(config.backend, config.backend),
            "inputs": [_tensor_metadata(s, config) for s in config.inputs],
            "outputs": [_tensor_metadata(s, config) for s in config.outputs],
        }

    def model_config(self, name: str, version: str = "") -> dict[str, Any]:
        return triton_config(self.manager.resolve(name, version).config)

    def model_statistics(self, name: str = "", version: str = "") -> dict[str, Any]:
        if name:
            versions = [self.manager.resolve(name, version)]
            if not version:
                versions = [self.manager.entry(name).versions[v] for v in sorted(self.manager.entry(name).versions)]
        else:
            versions = [
                v for row in self.manager.index(ready_only=True)
                for v in [self.manager.entry(row["name"]).versions.get(int(row["version"]))] if v
            ]
        return {"model_stats": [v.stats.as_dict() for v in versions]}

    # ------------------------------------------------------------ inference

    async def infer(self, request: InferRequest) -> InferResponse:
        loaded, outputs = await self.manager.infer(request)
        return InferResponse(
            model_name=request.model_name,
            model_version=str(loaded.version),
            outputs=outputs,
            id=request.id,
        )

    # ------------------------------------------------------------ repository

    def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        return self.manager.index(ready_only)

    async def load_model(self, name: str, parameters: dict[str, Any] | None = None) -> None:
        override = None
        for key, value in (parameters or {}).items():
            if key == "config":
                override = _parse_override(value, self.limits)
            elif key.startswith("file:"):
                raise InvalidRequestError("model file overrides ('file:' parameters) are not supported")
            else:
                raise InvalidRequestError(f"unknown load parameter '{key}'")
        await self.manager.load(name, override)

    async def unload_model(self, name: str, parameters: dict[str, Any] | None = None) -> None:
        parameters = parameters or {}
        unknown = set(parameters) - {"unload_dependents"}
        if unknown:
            raise InvalidRequestError(f"unknown unload parameter(s) {sorted(unknown)}")
        await self.manager.unload(name, bool(parameters.get("unload_dependents", False)))


def _parse_override(value: Any, limits: Limits) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise InvalidRequestError("the 'config' load parameter must be a JSON string")
    from kiln.serving.codecs.kserve_http import decode_json

    doc = decode_json(value.encode("utf-8"), limits)
    if not isinstance(doc, dict):
        raise InvalidRequestError("the 'config' load parameter must be a JSON object")
    return doc


def _tensor_metadata(spec: TensorSpec, config: ModelConfig) -> dict[str, Any]:
    shape = ([-1] if config.max_batch_size > 0 else []) + list(spec.dims)
    return {"name": spec.name, "datatype": spec.datatype, "shape": shape}


def _type_name(datatype: str) -> str:
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def triton_config(config: ModelConfig) -> dict[str, Any]:
    """The config in the shape of Triton's ModelConfig (protobuf JSON names)."""
    doc: dict[str, Any] = {
        "name": config.name,
        "platform": PLATFORMS.get(config.backend, config.backend),
        "backend": config.backend,
        "max_batch_size": config.max_batch_size,
        "input": [
            {"name": s.name, "data_type": _type_name(s.datatype), "dims": list(s.dims), "optional": s.optional}
            for s in config.inputs
        ],
        "output": [{"name": s.name, "data_type": _type_name(s.datatype), "dims": list(s.dims)} for s in config.outputs],
        "instance_group": [{"name": config.name, "count": config.instance_count,
                            "kind": "KIND_GPU" if config.device == "cuda" else "KIND_CPU"}],
        "parameters": {k: {"string_value": str(v)} for k, v in config.parameters.items()},
    }
    policy = config.version_policy
    if policy.all:
        doc["version_policy"] = {"all": {}}
    elif policy.specific is not None:
        doc["version_policy"] = {"specific": {"versions": list(policy.specific)}}
    else:
        doc["version_policy"] = {"latest": {"num_versions": policy.latest or 1}}
    if config.dynamic_batching is not None:
        b = config.dynamic_batching
        doc["dynamic_batching"] = {
            "preferred_batch_size": list(b.preferred_batch_sizes),
            "max_queue_delay_microseconds": int(b.max_queue_delay_ms * 1000),
            "default_queue_policy": {
                "max_queue_size": b.max_queue_size,
                "default_timeout_microseconds": int(b.default_timeout_ms * 1000),
            },
        }
    if config.steps:
        doc["ensemble_scheduling"] = {"step": [
            {"model_name": s.model, "model_version": s.version or -1,
             "input_map": dict(s.input_map), "output_map": dict(s.output_map)}
            for s in config.steps
        ]}
    return doc


def encode_json(value: Any) -> bytes:
    return msgspec.json.encode(value)
