"""ServerMetrics reads plain fields (no engine class): running totals become
monotonic counter increments, gauges follow the last step, latencies come
from a request's timestamps."""
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry

from kiln.metrics.server_metrics import LLMMetricFamilies, ServerMetrics

LABELS = {"model_name": "m"}


@dataclass
class Stats:
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_scheduled_seqs: int = 0
    step_seconds: float = 0.0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0


@dataclass
class Timing:
    arrival: float
    num_prompt_tokens: int
    first_token: float | None = None
    last_token: float | None = None
    num_generated: int = 0


@pytest.fixture
def metrics():
    registry = CollectorRegistry()
    return registry, ServerMetrics(LLMMetricFamilies(registry), "m")


def test_running_totals_become_counter_increments_and_gauges_follow_the_step(metrics):
    registry, m = metrics
    m.on_step(Stats(2, 1, 3, 12, prefix_cache_queries=10, prefix_cache_hits=4, num_scheduled_seqs=2,
                    step_seconds=0.02), [0.5, 0.25])
    m.on_step(Stats(1, 0, 1, 12, prefix_cache_queries=25, prefix_cache_hits=4, num_preemptions=1,
                    spec_num_draft_tokens=6, spec_num_accepted_tokens=5), [])
    m.on_step(None, [1.0])  # a step result without stats still reports queue times
    value = registry.get_sample_value
    assert value("kiln:prefix_cache_queries_total", LABELS) == 25
    assert value("kiln:prefix_cache_hits_total", LABELS) == 4
    assert value("kiln:num_preemptions_total", LABELS) == 1
    assert value("kiln:spec_decode_num_draft_tokens_total", LABELS) == 6
    assert value("kiln:spec_decode_num_accepted_tokens_total", LABELS) == 5
    assert value("kiln:num_requests_running", LABELS) == 1
    assert value("kiln:kv_cache_usage_perc", LABELS) == 1 / 12
    assert value("kiln:request_queue_time_seconds_count", LABELS) == 3
    assert value("kiln:request_queue_time_seconds_sum", LABELS) == 1.75
    # only the step that scheduled sequences counts towards batch size and step time
    assert value("kiln:batch_size_count", LABELS) == 1
    assert value("kiln:step_duration_seconds_sum", LABELS) == 0.02


def test_request_latencies_come_from_its_timestamps(metrics):
    registry, m = metrics
    times = Timing(arrival=10.0, num_prompt_tokens=7)
    m.on_tokens(times, 1, now=10.5)
    times.first_token = times.last_token = 10.5
    times.num_generated = 1
    m.on_tokens(times, 2, now=11.0)
    times.last_token, times.num_generated = 11.0, 3
    m.on_finished(times, "length")
    value = registry.get_sample_value
    assert value("kiln:time_to_first_token_seconds_sum", LABELS) == 0.5
    assert value("kiln:inter_token_latency_seconds_sum", LABELS) == 0.5
    assert value("kiln:prompt_tokens_total", LABELS) == 7
    assert value("kiln:generation_tokens_total", LABELS) == 3
    assert value("kiln:e2e_request_latency_seconds_sum", LABELS) == 1.0
    assert value("kiln:time_per_output_token_seconds_sum", LABELS) == 0.25
    assert value("kiln:request_success_total", {**LABELS, "finished_reason": "length"}) == 1
