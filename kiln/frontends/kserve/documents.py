"""KServe v2 / Triton documents (metadata, model config, statistics) built from
the data plane's typed answers. Both transports send these: HTTP as JSON,
gRPC through protobuf's JSON mapping."""

from __future__ import annotations

from typing import Any

import kiln
from kiln.serving.backends.registry import PLATFORMS
from kiln.serving.repository.config import RepositoryModelConfig, TensorSpec
from kiln.serving.stats import ModelStats

EXTENSIONS = ["binary_data", "model_configuration", "model_repository", "statistics", "schedule_policy"]


def server_metadata() -> dict[str, Any]:
    return {"name": "kiln", "version": kiln.__version__, "extensions": list(EXTENSIONS)}


def model_metadata(config: RepositoryModelConfig, versions: list[int]) -> dict[str, Any]:
    return {
        "name": config.name,
        "versions": [str(v) for v in versions],
        "platform": PLATFORMS.get(config.backend, config.backend),
        "inputs": [_tensor_metadata(s, config) for s in config.inputs],
        "outputs": [_tensor_metadata(s, config) for s in config.outputs],
    }


def statistics(stats: list[ModelStats]) -> dict[str, Any]:
    return {"model_stats": [s.as_dict() for s in stats]}


def _tensor_metadata(spec: TensorSpec, config: RepositoryModelConfig) -> dict[str, Any]:
    shape = ([-1] if config.max_batch_size > 0 else []) + list(spec.dims)
    return {"name": spec.name, "datatype": spec.datatype, "shape": shape}


def _type_name(datatype: str) -> str:
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def triton_config(config: RepositoryModelConfig) -> dict[str, Any]:
    """The config in the shape of Triton's RepositoryModelConfig (protobuf JSON names)."""
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
        "version_policy": _version_policy(config),
    }
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


def _version_policy(config: RepositoryModelConfig) -> dict[str, Any]:
    policy = config.version_policy
    if policy.all:
        return {"all": {}}
    if policy.specific is not None:
        return {"specific": {"versions": list(policy.specific)}}
    return {"latest": {"num_versions": policy.latest or 1}}
