"""A model config in Triton's JSON form, read back as a config.yaml mapping.

`GET /v2/models/NAME/config` answers in Triton's form (protobuf JSON names:
`input`, `data_type: TYPE_FP32`, `instance_group`, ...), so a tritonclient
user's `load_model(NAME, config=json.dumps(edited))` sends that form back.
`from_triton` turns it into Kiln's config.yaml mapping.

Triton's form has no place for some of Kiln's settings (`variable_shapes`,
`pad_value`, `trim_outputs`, `priority_aging_s`, `warmup`, `artifact`,
`max_inline_ms`, the queue policy of a model without batching, the types of
`parameters`): those keep the values of the model's current config (`base`).
A field is written only where it differs from `base`, so a config read and
sent back unchanged loads the same model. Triton fields Kiln has no use for
are refused by name.
"""
from __future__ import annotations

from typing import Any

from kiln.errors import ConfigError
from kiln.serving.backends.registry import PLATFORMS
from kiln.serving.repository.config import RepositoryModelConfig, VersionPolicy

FIELDS = {"name", "platform", "backend", "max_batch_size", "input", "output", "instance_group", "parameters",
          "version_policy", "dynamic_batching", "ensemble_scheduling"}
# Keys that only Triton's form has: a document with one of them is read as Triton's.
MARKERS = {"platform", "input", "output", "instance_group", "ensemble_scheduling"}
TENSOR_FIELDS = {"name", "data_type", "dims", "optional"}
BACKEND_OF_PLATFORM = {platform: backend for backend, platform in PLATFORMS.items()}


def is_triton_form(doc: dict[str, Any]) -> bool:
    batching = doc.get("dynamic_batching")
    return bool(MARKERS & set(doc)) or (isinstance(batching, dict) and "max_queue_delay_microseconds" in batching)


def from_triton(doc: dict[str, Any], base: RepositoryModelConfig | None) -> dict[str, Any]:
    """The config.yaml mapping `doc` (Triton's form) describes, on top of `base`."""
    unknown = sorted(set(doc) - FIELDS)
    if unknown:
        raise ConfigError(f"Triton config field(s) {unknown} are not supported by Kiln (docs/repository.md)")
    out = base.model_dump(exclude_unset=True) if base is not None else {}

    def now(key: str) -> Any:
        return getattr(base, key) if base is not None else RepositoryModelConfig.model_fields[key].default

    def put(key: str, value: Any) -> None:
        if value != now(key) or key in out:
            out[key] = value

    if "name" in doc:
        out["name"] = doc["name"]
    out["backend"] = _backend(doc) if ("backend" in doc or "platform" in doc) else now("backend")
    if "max_batch_size" in doc:
        put("max_batch_size", _int(doc["max_batch_size"], "max_batch_size"))
    for key, kiln_key in (("input", "inputs"), ("output", "outputs")):
        if key in doc:
            out[kiln_key] = [_tensor(t, f"{key}[{i}]") for i, t in enumerate(_list(doc[key], key))]
    if "instance_group" in doc:
        count, device = _instances(_list(doc["instance_group"], "instance_group"))
        put("instance_count", count)
        put("device", device)
    if "parameters" in doc:
        put("parameters", _parameters(doc["parameters"], now("parameters")))
    if "version_policy" in doc:
        policy = _version_policy(doc["version_policy"])
        if policy != _policy_of(now("version_policy")) or "version_policy" in out:  # no policy = latest 1
            out["version_policy"] = policy
    _batching(doc.get("dynamic_batching"), out)
    if "ensemble_scheduling" in doc:
        out["steps"] = _steps(doc["ensemble_scheduling"])
    return out


def _backend(doc: dict[str, Any]) -> str:
    if "backend" in doc:
        return str(doc["backend"])
    platform = doc.get("platform")
    if platform not in BACKEND_OF_PLATFORM:
        raise ConfigError(f"unknown platform {platform!r}: Kiln serves {sorted(BACKEND_OF_PLATFORM)}")
    return BACKEND_OF_PLATFORM[platform]


def _int(value: Any, where: str) -> int:
    """protobuf JSON writes int64 fields as strings ("-1")."""
    text = str(value).strip()
    if isinstance(value, bool) or not (text.lstrip("-").isascii() and text.lstrip("-").isdigit()):
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    return int(text)


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ConfigError(f"{where} must be a list, got {type(value).__name__}")
    return value


def _tensor(spec: Any, where: str) -> dict[str, Any]:
    if not isinstance(spec, dict):
        raise ConfigError(f"{where} must be an object")
    unknown = sorted(set(spec) - TENSOR_FIELDS)
    if unknown:
        raise ConfigError(f"{where}: Triton tensor field(s) {unknown} are not supported by Kiln")
    data_type = str(spec.get("data_type", ""))
    if not data_type.startswith("TYPE_"):
        raise ConfigError(f"{where}: data_type must be TYPE_<type> (TYPE_FP32, TYPE_STRING, ...), got {data_type!r}")
    datatype = "BYTES" if data_type == "TYPE_STRING" else data_type[len("TYPE_"):]
    out = {"name": spec.get("name"), "datatype": datatype,
           "dims": [_int(d, f"{where}.dims") for d in _list(spec.get("dims", []), f"{where}.dims")]}
    if spec.get("optional"):
        out["optional"] = True
    return out


def _instances(groups: list[Any]) -> tuple[int, str]:
    kinds = {str(g.get("kind", "KIND_CPU")) for g in groups if isinstance(g, dict)}
    if len(kinds) > 1 or not kinds <= {"KIND_CPU", "KIND_GPU"}:
        raise ConfigError(f"instance_group: one kind, KIND_CPU or KIND_GPU, got {sorted(kinds)}")
    count = sum(_int(g.get("count", 1), "instance_group.count") for g in groups)
    return count, "cuda" if kinds == {"KIND_GPU"} else "cpu"


def _parameters(params: Any, current: dict[str, Any]) -> dict[str, Any]:
    """{name: {"string_value": text}}: each text read back as the type the model's config gives it."""
    if not isinstance(params, dict):
        raise ConfigError("parameters must be an object")
    out = {}
    for key, value in params.items():
        text = value.get("string_value") if isinstance(value, dict) else value
        if not isinstance(text, str):
            raise ConfigError(f"parameters.{key} must be {{\"string_value\": \"...\"}}")
        out[key] = _typed(text, current.get(key), key)
    return out


def _typed(text: str, like: Any, key: str) -> Any:
    try:
        if isinstance(like, bool):
            if text.lower() not in ("true", "false"):
                raise ValueError(text)
            return text.lower() == "true"
        if isinstance(like, int):
            return int(text)
        if isinstance(like, float):
            return float(text)
    except ValueError:
        raise ConfigError(f"parameters.{key} must be a {type(like).__name__} like the model's, got {text!r}") from None
    return text


def _version_policy(policy: Any) -> dict[str, Any]:
    if not isinstance(policy, dict) or len(policy) != 1:
        raise ConfigError("version_policy must be one of {latest: {num_versions}}, {all: {}}, {specific: {versions}}")
    (kind, body), = policy.items()
    body = body if isinstance(body, dict) else {}
    if kind == "latest":
        return {"latest": _int(body.get("num_versions", 1), "version_policy.latest.num_versions")}
    if kind == "all":
        return {"all": True}
    if kind == "specific":
        versions = _list(body.get("versions", []), "version_policy.specific.versions")
        return {"specific": [_int(v, "version_policy.specific.versions") for v in versions]}
    raise ConfigError(f"unknown version_policy {kind!r}: latest, all or specific")


def _policy_of(policy: VersionPolicy) -> dict[str, Any]:
    if policy.all:
        return {"all": True}
    if policy.specific is not None:
        return {"specific": list(policy.specific)}
    return {"latest": policy.latest or 1}


def _batching(batching: Any, out: dict[str, Any]) -> None:
    """Triton's dynamic_batching over the model's own (its Kiln-only fields kept); absent: none."""
    if batching is None:
        out.pop("dynamic_batching", None)
        return
    if not isinstance(batching, dict):
        raise ConfigError("dynamic_batching must be an object")
    unknown = sorted(set(batching) - {"preferred_batch_size", "max_queue_delay_microseconds", "default_queue_policy"})
    if unknown:
        raise ConfigError(f"dynamic_batching: Triton field(s) {unknown} are not supported by Kiln")
    merged = dict(out.get("dynamic_batching") or {})
    if "preferred_batch_size" in batching:
        sizes = _list(batching["preferred_batch_size"], "dynamic_batching.preferred_batch_size")
        merged["preferred_batch_sizes"] = [_int(s, "dynamic_batching.preferred_batch_size") for s in sizes]
    if "max_queue_delay_microseconds" in batching:
        merged["max_queue_delay_ms"] = _int(batching["max_queue_delay_microseconds"], "max_queue_delay") / 1000
    policy = batching.get("default_queue_policy") or {}
    if "max_queue_size" in policy:
        merged["max_queue_size"] = _int(policy["max_queue_size"], "default_queue_policy.max_queue_size")
    if "default_timeout_microseconds" in policy:
        timeout = _int(policy["default_timeout_microseconds"], "default_queue_policy.default_timeout_microseconds")
        merged["default_timeout_ms"] = timeout / 1000
    out["dynamic_batching"] = merged


def _steps(scheduling: Any) -> list[dict[str, Any]]:
    steps = _list((scheduling or {}).get("step"), "ensemble_scheduling.step")
    out = []
    for i, step in enumerate(steps):
        version = _int(step.get("model_version", -1), f"ensemble_scheduling.step[{i}].model_version")
        out.append({"model": step.get("model_name"), "input_map": step.get("input_map", {}),
                    "output_map": step.get("output_map", {}), **({"version": version} if version != -1 else {})})
    return out
