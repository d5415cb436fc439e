"""What one measurement holds, and what the search maximises.

Objective: the largest throughput a configuration sustains within the SLOs
(p99 latency for repository models; p99 TTFT, p99 TPOT and optionally p99
end-to-end latency for LLMs) with no failed request. Throughput is
inferences/s (batch rows) for repository models and output tokens/s for
LLMs. A configuration with no load level inside the SLOs scores 0.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class Point:
    """One configuration driven at one load level."""

    level: float  # concurrency (requests in flight) or request rate (requests/s)
    duration_s: float = 0.0
    requests: int = 0
    errors: int = 0
    throughput_rps: float = 0.0  # requests/s
    inferences_per_s: float = 0.0  # rows/s (repository models)
    output_tokens_per_s: float = 0.0  # LLMs
    p50_ms: float = 0.0
    p90_ms: float = 0.0
    p99_ms: float = 0.0
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    memory_bytes: int | None = None  # resident memory of every server process
    model_memory_bytes: int | None = None  # what the engine reports (weights + KV pool)
    server_cost_per_1k_usd: float | None = None  # the server's own gauge, when it had a price
    first_error: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Point:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class Objective:
    kind: str  # "repository" or "llm"
    max_p99_latency_ms: float | None = None
    max_p99_ttft_ms: float | None = None
    max_p99_tpot_ms: float | None = None

    def throughput(self, point: Point) -> float:
        return point.output_tokens_per_s if self.kind == "llm" else point.inferences_per_s

    @property
    def unit(self) -> str:
        return "output tokens/s" if self.kind == "llm" else "inferences/s"

    def violation(self, point: Point) -> str | None:
        """Why `point` is outside the SLOs, or None."""
        if point.requests == 0:
            return "no request completed"
        if point.errors:
            return f"{point.errors} failed requests ({point.first_error or 'no detail'})"
        checks = (
            ("p99 latency", point.p99_ms, self.max_p99_latency_ms),
            ("p99 TTFT", point.ttft_p99_ms, self.max_p99_ttft_ms),
            ("p99 TPOT", point.tpot_p99_ms, self.max_p99_tpot_ms),
        )
        for name, value, limit in checks:
            if limit is not None and value is not None and value > limit:
                return f"{name} {value:.1f} ms > {limit:g} ms"
        return None

    def describe(self) -> str:
        limits = [f"{name} <= {limit:g} ms" for name, limit in (
            ("p99 latency", self.max_p99_latency_ms), ("p99 TTFT", self.max_p99_ttft_ms),
            ("p99 TPOT", self.max_p99_tpot_ms)) if limit is not None]
        return f"maximise {self.unit}" + (f" subject to {', '.join(limits)}" if limits else "") + ", no failed request"


def cost_per_1k(price_per_hour: float | None, predictions_per_s: float) -> float | None:
    """USD per 1,000 predictions of a server kept busy at this throughput."""
    if price_per_hour is None or predictions_per_s <= 0:
        return None
    return 1000.0 * price_per_hour / 3600.0 / predictions_per_s
