"""Prometheus metrics: engine and request metrics, process and device gauges."""
