"""Per model-version statistics in the KServe statistics-extension shape.

Counts are plain ints updated on the event loop thread only, so no lock is
needed. Durations are nanoseconds.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int) -> None:
        self.count += 1
        self.ns += max(0, int(ns))

    def as_dict(self) -> dict:
        return {"count": self.count, "ns": self.ns}


@dataclass
class BatchStats:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass
class ModelStats:
    name: str
    version: str
    last_inference_ms: int = 0
    inference_count: int = 0  # requests' batch rows that ran
    execution_count: int = 0  # backend executions (batches)
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    batches: dict[int, BatchStats] = field(default_factory=dict)

    def record_execution(self, batch_size: int, requests: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        self.execution_count += 1
        self.inference_count += batch_size
        self.last_inference_ms = int(time.time() * 1000)
        per = self.batches.setdefault(batch_size, BatchStats())
        per.compute_input.add(input_ns)
        per.compute_infer.add(infer_ns)
        per.compute_output.add(output_ns)
        # Per-request compute durations: every request in the batch shares them.
        for _ in range(requests):
            self.compute_input.add(input_ns)
            self.compute_infer.add(infer_ns)
            self.compute_output.add(output_ns)

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "version": self.version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.as_dict(),
                "fail": self.fail.as_dict(),
                "queue": self.queue.as_dict(),
                "compute_input": self.compute_input.as_dict(),
                "compute_infer": self.compute_infer.as_dict(),
                "compute_output": self.compute_output.as_dict(),
                "cache_hit": {"count": 0, "ns": 0},
                "cache_miss": {"count": 0, "ns": 0},
            },
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": b.compute_input.as_dict(),
                    "compute_infer": b.compute_infer.as_dict(),
                    "compute_output": b.compute_output.as_dict(),
                }
                for size, b in sorted(self.batches.items())
            ],
        }
