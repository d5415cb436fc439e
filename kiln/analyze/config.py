"""`kiln analyze` options (the CLI derives one flag per field)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.config import option
from kiln.errors import ConfigError

SEARCHES = ("coordinate", "optuna")
PROTOCOLS = ("http", "grpc")


MAX_LEVEL_DURATION_S = 3600.0


def parse_levels(text: str, name: str, integers: bool = False) -> tuple[float, ...]:
    """Positive, finite, increasing numbers (`integers`: whole ones, as concurrency levels)."""
    try:
        levels = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{name} takes comma-separated numbers, got {text!r}", param=name) from None
    if not levels or not all(0 < v < math.inf for v in levels) or list(levels) != sorted(set(levels)):
        raise ConfigError(f"{name} must be positive, finite, increasing numbers, got {text!r}", param=name)
    if integers and not all(v.is_integer() for v in levels):
        raise ConfigError(f"{name} must be whole numbers, got {text!r}", param=name)
    return levels


@dataclass(frozen=True)
class AnalyzeConfig:
    model_repository: str | None = option(None, "analyze a model of this repository (with --model-name)")
    model_name: str | None = option(None, "the repository model to analyze")
    output: str = option("kiln-analysis", "directory for results.jsonl, the report, plots and the best config")
    search: str = option("coordinate", "coordinate: one parameter at a time; optuna: TPE sampling", SEARCHES)
    trials: int = option(20, "configurations optuna samples (--search optuna)")
    max_configs: int | None = option(None, "stop after measuring this many configurations")
    max_passes: int = option(2, "coordinate search: passes over the parameters at most")
    min_gain: float = option(0.02, "a configuration must beat the best so far by this fraction to win")
    max_p99_latency_ms: float | None = option(None, "SLO: p99 request latency (end to end for LLMs), ms")
    max_p99_ttft_ms: float | None = option(None, "SLO (LLMs): p99 time to first token, ms")
    max_p99_tpot_ms: float | None = option(None, "SLO (LLMs): p99 time per output token, ms")
    concurrency: str = option("1,2,4,8,16,32,64", "repository models: concurrency levels, increasing")
    request_rates: str = option("0.5,1,2,4,8,16,32", "LLMs: request rates (requests/s) to sweep, increasing")
    level_duration_s: float = option(5.0, "seconds of load per level (LLMs: rate x this many requests)")
    protocol: str = option("http", "repository models: KServe v2 over HTTP or gRPC", PROTOCOLS)
    batch_size: int = option(1, "repository models: rows per request")
    input_len: int = option(128, "LLMs: prompt length in words")
    output_len: int = option(64, "LLMs: tokens generated per request")
    price_per_hour: float | None = option(None, "USD per hour of the server: adds cost per 1,000 predictions")
    fresh_server: bool = option(False, "start a new server for every configuration (clean memory figures)")
    resume: bool = option(True, "reuse the points an earlier run with the same model and workload left in --output")
    workload_seed: int = option(0, "seed of the prompts, inputs and arrivals")

    def __post_init__(self) -> None:
        if self.search not in SEARCHES:
            raise ConfigError(f"search must be one of {SEARCHES}", param="search")
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"protocol must be one of {PROTOCOLS}", param="protocol")
        for name in ("trials", "max_passes", "batch_size", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive", param=name)
        if self.max_configs is not None and self.max_configs < 1:
            raise ConfigError("max_configs must be positive", param="max_configs")
        if not 0 <= self.min_gain < 1:
            raise ConfigError("min_gain must be in [0, 1)", param="min_gain")
        if not 0 < self.level_duration_s <= MAX_LEVEL_DURATION_S:
            raise ConfigError(f"level_duration_s must be in (0, {MAX_LEVEL_DURATION_S:g}]", param="level_duration_s")
        for name in ("max_p99_latency_ms", "max_p99_ttft_ms", "max_p99_tpot_ms", "price_per_hour"):
            value = getattr(self, name)
            if value is not None and not 0 < value < math.inf:  # inf / NaN too: the server refuses them later
                raise ConfigError(f"{name} must be a positive, finite number", param=name)
        if (self.model_repository is None) != (self.model_name is None):
            raise ConfigError("--model-repository and --model-name go together", param="model_name")
        parse_levels(self.concurrency, "concurrency", integers=True)
        parse_levels(self.request_rates, "request_rates")
