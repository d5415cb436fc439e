"""The configuration space worth searching, per kind of model.

A configuration is a flat dict {parameter: value}. Each `Param` lists its
candidate values; `ordered` parameters are numeric and increasing, so the
coordinate search may walk them outward from the current value and stop at
the first value that is no better (kiln/analyze/search.py). The base
configuration (the model's own config.yaml, or the engine flags given) is
always one of the candidates, so the search starts from what the user has.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from kiln.config import EngineConfig, flat_options
from kiln.errors import ConfigError

Value = bool | int | float | str | None
Config = dict[str, Value]


@dataclass(frozen=True)
class Param:
    name: str
    values: tuple[Value, ...]
    ordered: bool
    help: str

    def with_value(self, value: Value) -> Param:
        """This parameter with `value` among its candidates (kept sorted when ordered)."""
        if value in self.values:
            return self
        values = (*self.values, value)
        if self.ordered and all(isinstance(v, int | float) for v in values):
            values = tuple(sorted(values, key=float))  # type: ignore[arg-type]
        return replace(self, values=values)


@dataclass(frozen=True)
class SearchSpace:
    kind: str  # "repository" or "llm"
    params: tuple[Param, ...]
    base: Config  # the starting configuration: a value for every param

    def __post_init__(self) -> None:
        missing = [p.name for p in self.params if p.name not in self.base]
        if missing:
            raise ConfigError(f"the base configuration has no value for {missing}")

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise ConfigError(f"unknown parameter {name!r}; this model's parameters: {[p.name for p in self.params]}")

    def size(self) -> int:
        total = 1
        for p in self.params:
            total *= len(p.values)
        return total

    def restricted(self, overrides: dict[str, tuple[Value, ...]]) -> SearchSpace:
        """Only the parameters named, over the values given (plus the base value).

        The others keep their base value and are not searched."""
        if not overrides:
            return self
        params = []
        for name, values in overrides.items():
            param = self.param(name)
            if not values:
                raise ConfigError(f"--param {name}= needs at least one value")
            params.append(replace(param, values=tuple(dict.fromkeys(values))).with_value(self.base[name]))
        return replace(self, params=tuple(params))


def config_key(config: Config) -> str:
    """A stable text key of a configuration (the result store's)."""
    import json

    return json.dumps(config, sort_keys=True)


def parse_value(param: Param, text: str) -> Value:
    """`text` as a value of `param`: its existing values' type decides (none -> None)."""
    text = text.strip()
    if text.lower() in ("none", "null") and None in param.values:
        return None
    kinds = {type(v) for v in param.values if v is not None}
    if bool in kinds:
        if text.lower() in ("true", "on", "1", "yes"):
            return True
        if text.lower() in ("false", "off", "0", "no"):
            return False
        raise ConfigError(f"{param.name} takes on/off, got {text!r}")
    try:
        if kinds == {int}:
            return int(text)
        if kinds <= {int, float}:
            return float(text)
    except ValueError:
        raise ConfigError(f"{param.name} takes numbers, got {text!r}") from None
    return text


def parse_overrides(space: SearchSpace, specs: list[str]) -> dict[str, tuple[Value, ...]]:
    """`["max_batch_size=8,64", ...]` -> {"max_batch_size": (8, 64)}."""
    out: dict[str, tuple[Value, ...]] = {}
    for spec in specs:
        name, sep, values = spec.partition("=")
        if not sep:
            raise ConfigError(f"--param takes NAME=V1,V2,..., got {spec!r}")
        param = space.param(name.strip())
        out[param.name] = tuple(parse_value(param, v) for v in values.split(",") if v.strip())
    return out


# ---- repository models -------------------------------------------------------

PREFERRED_CHOICES = ("none", "max", "pow2")


def preferred_sizes(choice: Value, max_batch_size: int) -> tuple[int, ...]:
    """What a preferred_batch_sizes value means for a given max_batch_size.

    none: no preference; max: only full batches; pow2: max/4, max/2, max;
    "16,32": those sizes (the base config's own list)."""
    if choice == "none":
        return ()
    if choice == "max":
        return (max_batch_size,)
    if choice == "pow2":
        return tuple(sorted({s for s in (max_batch_size // 4, max_batch_size // 2, max_batch_size) if s >= 1}))
    return tuple(int(s) for s in str(choice).split(",") if s.strip())


def repository_space(raw: dict[str, Any]) -> SearchSpace:
    """The space of a repository model, from its config.yaml mapping."""
    backend = raw.get("backend")
    if backend == "ensemble":
        raise ConfigError("an ensemble has no configuration of its own to tune: analyze its step models")
    if backend == "llm":
        raise ConfigError(
            "an llm repository model is tuned through its engine: run `kiln analyze` on the model file "
            "(engine flags), then put the recommended flags in its config.yaml parameters"
        )
    cores = os.cpu_count() or 1
    batching = raw.get("dynamic_batching") or {}
    max_batch = int(raw.get("max_batch_size", 0))
    params: list[Param] = []
    base: Config = {}
    if max_batch > 0:
        preferred = batching.get("preferred_batch_sizes") or ()
        params += [
            Param("max_batch_size", (8, 16, 32, 64, 128), True, "largest batch the batcher forms"),
            Param("max_queue_delay_ms", (0.0, 1.0, 2.0, 5.0, 10.0), True, "how long a batch may wait to fill"),
            Param("preferred_batch_sizes", PREFERRED_CHOICES, False, "batch sizes the batcher prefers to run"),
        ]
        base.update(
            max_batch_size=max_batch,
            max_queue_delay_ms=float(batching.get("max_queue_delay_ms", 0.0)),
            preferred_batch_sizes=",".join(str(s) for s in sorted(preferred)) if preferred else "none",
        )
    params.append(Param("instance_count", tuple(n for n in (1, 2, 4) if n <= max(2, cores)), True,
                        "copies of the model executing batches in parallel"))
    base["instance_count"] = int(raw.get("instance_count", 1))
    if backend == "onnxruntime":
        threads = tuple(n for n in (1, 2, 4, 8) if n <= max(2, cores))
        params.append(Param("intra_op_num_threads", threads, True, "onnxruntime threads per execution"))
        base["intra_op_num_threads"] = int((raw.get("parameters") or {}).get("intra_op_num_threads", 0))
    params = [p.with_value(base[p.name]) for p in params]
    return SearchSpace("repository", tuple(params), base)


def apply_repository(raw: dict[str, Any], config: Config) -> dict[str, Any]:
    """The config.yaml mapping `raw` with `config` applied (raw is not changed)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    if "max_batch_size" in config:
        max_batch = int(config["max_batch_size"])  # type: ignore[arg-type]
        out["max_batch_size"] = max_batch
        batching = dict(out.get("dynamic_batching") or {})
        batching["max_queue_delay_ms"] = config["max_queue_delay_ms"]
        sizes = preferred_sizes(config["preferred_batch_sizes"], max_batch)
        batching["preferred_batch_sizes"] = list(sizes)
        out["dynamic_batching"] = batching
    out["instance_count"] = config["instance_count"]
    if "intra_op_num_threads" in config:
        out["parameters"] = {**(out.get("parameters") or {}), "intra_op_num_threads": config["intra_op_num_threads"]}
    return out


# ---- LLMs ----------------------------------------------------------------------

def llm_space(base_options: dict[str, Any]) -> SearchSpace:
    """The engine options worth searching, around `base_options` (flat EngineConfig options)."""
    engine = EngineConfig.from_flat(**base_options)
    cuda = engine.model.device.startswith("cuda")
    kv_dtypes: tuple[Value, ...] = ("auto", "bfloat16", "float16") + (("fp8_e4m3",) if cuda else ())
    params = [
        Param("max_num_seqs", (8, 16, 32, 64, 128, 256), True, "most requests running at once"),
        Param("max_num_batched_tokens", (256, 512, 1024, 2048, 4096), True, "token budget of one engine step"),
        Param("enable_chunked_prefill", (True, False), False, "split long prompts over several steps"),
        # Unset (None: a fraction of available memory) is no point on the GiB line: then every value is tried.
        Param("kv_cache_memory_gib", (0.25, 0.5, 1.0, 2.0, 4.0), engine.cache.kv_cache_memory_gib is not None,
              "memory of the paged KV pool, GiB"),
        Param("kv_cache_dtype", kv_dtypes, False, "what the KV pool stores"),
        Param("quantization", (None, "int8", "int4"), False, "weight-only quantization"),
        Param("spec_method", (None, "ngram"), False, "speculative decoding (prompt-lookup drafts)"),
    ]
    base: Config = {
        "max_num_seqs": engine.scheduler.max_num_seqs,
        "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens,
        "enable_chunked_prefill": engine.scheduler.enable_chunked_prefill,
        "kv_cache_memory_gib": engine.cache.kv_cache_memory_gib,
        "kv_cache_dtype": engine.cache.kv_cache_dtype,
        "quantization": engine.model.quantization,
        "spec_method": engine.spec.spec_method,
    }
    flat_options(engine)  # the base must round-trip (validated above)
    return SearchSpace("llm", tuple(p.with_value(base[p.name]) for p in params), base)


def apply_llm(base_options: dict[str, Any], config: Config) -> dict[str, Any]:
    """Flat engine options: the base ones with `config` applied, validated (ConfigError if not)."""
    options = {**base_options, **config}
    return flat_options(EngineConfig.from_flat(**options))
