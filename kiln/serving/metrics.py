"""Prometheus metrics of general model serving, on a registry passed in.

Names follow Triton's (`nv_inference_*`) with a `kiln_` prefix; labels are
`model` and `version`. The lead merges `ServingMetrics.registry` into the
server's /metrics (or passes the shared registry in).
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_LABELS = ("model", "version")


class ServingMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.success = Counter("kiln_inference_request_success", "Successful inference requests", _LABELS, registry=r)
        self.failure = Counter(
            "kiln_inference_request_failure", "Failed inference requests by reason", (*_LABELS, "reason"), registry=r
        )
        self.inference_count = Counter("kiln_inference_count", "Inferences run (batch rows)", _LABELS, registry=r)
        self.exec_count = Counter("kiln_inference_exec_count", "Backend executions (batches)", _LABELS, registry=r)
        self.pending = Gauge("kiln_inference_pending_request_count", "Requests queued or running", _LABELS, registry=r)
        self.request_us = Counter("kiln_inference_request_duration_us", "Cumulative request time", _LABELS, registry=r)
        self.latency = Histogram(
            "kiln_inference_request_latency_seconds", "Request latency (queue + compute), successes and failures",
            _LABELS, buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.queue_us = Counter("kiln_inference_queue_duration_us", "Cumulative queue time", _LABELS, registry=r)
        self.input_us = Counter(
            "kiln_inference_compute_input_duration_us", "Cumulative input preparation time", _LABELS, registry=r
        )
        self.infer_us = Counter(
            "kiln_inference_compute_infer_duration_us", "Cumulative compute time", _LABELS, registry=r
        )
        self.output_us = Counter(
            "kiln_inference_compute_output_duration_us", "Cumulative output extraction time", _LABELS, registry=r
        )
        self.batch_size = Histogram(
            "kiln_inference_batch_size", "Rows per backend execution", _LABELS, buckets=_BATCH_BUCKETS, registry=r
        )
        self.load_seconds = Gauge("kiln_model_load_duration_secs", "Time to load the model", _LABELS, registry=r)
        # Labelled children, looked up once: `labels()` costs microseconds and runs several times per request.
        self._children: dict[tuple[int, str, str], Any] = {}

    def child(self, metric: Counter | Gauge | Histogram, model: str, version: str) -> Any:
        key = (id(metric), model, version)  # the metrics live as long as this object
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(model, version)
        return found

    def request_done(self, model: str, version: str, ok: bool, duration_ns: int, reason: str = "OTHER") -> None:
        if ok:
            self.child(self.success, model, version).inc()
        else:
            self.failure.labels(model, version, reason if reason in FAILURE_REASONS else "OTHER").inc()
        self.child(self.request_us, model, version).inc(duration_ns / 1000)
        self.child(self.latency, model, version).observe(duration_ns / 1e9)

    def execution(self, model: str, version: str, rows: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        self.child(self.exec_count, model, version).inc()
        self.child(self.inference_count, model, version).inc(rows)
        self.child(self.batch_size, model, version).observe(rows)
        self.child(self.input_us, model, version).inc(input_ns / 1000)
        self.child(self.infer_us, model, version).inc(infer_ns / 1000)
        self.child(self.output_us, model, version).inc(output_ns / 1000)
