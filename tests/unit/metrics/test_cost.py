"""The sliding window and the cost formula, with exact numbers on a fake clock."""

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kiln.metrics.cost import CostCollector, UsageReading, attribute_cost
from kiln.metrics.window import SlidingWindow


def test_window_subtracts_the_newest_snapshot_at_least_a_window_old():
    w = SlidingWindow(10.0)
    for t in range(0, 30, 2):  # a snapshot every 2 s: counter = 3 * t
        w.add(float(t), {"m": (3.0 * t,)})
    # now = 29: the window opens at the newest snapshot <= 19, which is t = 18
    span, deltas = w.deltas(29.0, {"m": (87.0,)})
    assert span == 11.0 and deltas == {"m": (87.0 - 54.0,)}
    assert [t for t, _ in w.samples] == [18.0, 20.0, 22.0, 24.0, 26.0, 28.0]


def test_window_counts_new_and_reset_keys_from_zero():
    w = SlidingWindow(60.0)
    w.add(0.0, {"old": (5.0, 1.0), "reloaded": (100.0, 9.0)})
    span, deltas = w.deltas(30.0, {"old": (7.0, 1.0), "reloaded": (4.0, 2.0), "new": (3.0, 3.0)})
    assert span == 30.0
    assert deltas == {"old": (2.0, 0.0), "reloaded": (4.0, 2.0), "new": (3.0, 3.0)}
    assert SlidingWindow(5.0).deltas(1.0, {"x": (1.0,)}) == (0.0, {})


def test_cost_is_the_windows_price_shared_by_busy_time():
    # $3.60/h over 100 s = $0.10; a was busy 30 s, b 10 s: a pays 3/4, b 1/4 (idle time included)
    costs = attribute_cost(3.6, 100.0, {"a": (30.0, 600, 12_000), "b": (10.0, 50, 0), "idle": (0.0, 0, 0)})
    assert costs["a"].cost_usd == pytest.approx(0.075) and costs["b"].cost_usd == pytest.approx(0.025)
    assert costs["a"].per_1k_requests == pytest.approx(1000 * 0.075 / 600)
    assert costs["a"].per_1m_output_tokens == pytest.approx(1e6 * 0.075 / 12_000)
    assert costs["b"].per_1k_requests == pytest.approx(0.5) and costs["b"].per_1m_output_tokens is None
    assert costs["a"].busy_fraction == pytest.approx(0.3)
    assert costs["idle"].cost_usd == 0 and costs["idle"].per_1k_requests is None


def test_nothing_busy_attributes_nothing():
    costs = attribute_cost(10.0, 60.0, {"a": (0.0, 5, 0)})
    assert costs["a"].per_1k_requests is None
    assert attribute_cost(10.0, 0.0, {"a": (1.0, 1, 1)}) == {}


def scrape(collector) -> dict[tuple, float]:
    registry = CollectorRegistry()
    registry.register(collector)
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            out[(sample.name, *sorted(sample.labels.items()))] = sample.value
    return out


def test_collector_exports_per_model_and_per_route_target_gauges():
    clock = [0.0]
    usage = {("chat", "1"): UsageReading(0.0, 0, 0, llm=True), ("ranker", "2"): UsageReading(0.0, 0, 0, llm=False)}
    collector = CostCollector(lambda: usage, price_per_hour=7.2, window_s=300.0,
                              route_targets=lambda: [("front", "chat@1", ("chat", "1")), ("front", "gone", ("x", "1"))],
                              clock=lambda: clock[0])
    collector.sample()
    clock[0] = 100.0  # $7.20/h for 100 s = $0.20; chat busy 40 s, ranker 10 s
    usage[("chat", "1")] = UsageReading(40.0, 400, 80_000, llm=True)
    usage[("ranker", "2")] = UsageReading(10.0, 1000, 0, llm=False)
    values = scrape(collector)
    chat, ranker = (("model", "chat"), ("version", "1")), (("model", "ranker"), ("version", "2"))
    assert values[("kiln:cost_per_1k_requests_usd", *chat)] == pytest.approx(1000 * 0.16 / 400)
    assert values[("kiln:cost_per_1m_output_tokens_usd", *chat)] == pytest.approx(1e6 * 0.16 / 80_000)
    assert values[("kiln:cost_per_1k_requests_usd", *ranker)] == pytest.approx(1000 * 0.04 / 1000)
    assert ("kiln:cost_per_1m_output_tokens_usd", *ranker) not in values  # not an LLM
    assert values[("kiln:model_busy_fraction", *chat)] == pytest.approx(0.4)
    assert values[("kiln:cost_window_seconds",)] == 100.0 and values[("kiln:server_price_per_hour_usd",)] == 7.2
    target = (("route", "front"), ("target", "chat@1"))
    assert values[("kiln:route_cost_per_1k_requests_usd", *target)] == pytest.approx(0.4)
    assert ("kiln:route_cost_per_1k_requests_usd", ("route", "front"), ("target", "gone")) not in values


def test_without_a_price_only_busy_time_is_exported():
    collector = CostCollector(lambda: {("m", "1"): UsageReading(1.0, 1, 0, llm=False)}, None, 60.0)
    names = {key[0] for key in scrape(collector)}
    assert "kiln:model_busy_fraction" in names and "kiln:cost_per_1k_requests_usd" not in names


def test_a_version_unloaded_or_reloaded_keeps_its_share_while_its_use_is_in_the_window():
    clock = [0.0]
    usage = {("chat", "1"): UsageReading(0.0, 0, 0, llm=True), ("ranker", "1"): UsageReading(0.0, 0, 0, llm=False)}
    collector = CostCollector(lambda: dict(usage), price_per_hour=3.6, window_s=60.0, clock=lambda: clock[0])
    collector.sample()
    clock[0] = 10.0  # $3.60/h for 10 s = $0.01: chat busy 9 s, ranker 1 s
    usage[("chat", "1")] = UsageReading(9.0, 3, 30, llm=True)
    usage[("ranker", "1")] = UsageReading(1.0, 10, 0, llm=False)
    collector.sample()
    ranker = ("kiln:cost_per_1k_requests_usd", ("model", "ranker"), ("version", "1"))
    chat = ("kiln:cost_per_1k_requests_usd", ("model", "chat"), ("version", "1"))
    before = scrape(collector)[ranker]
    assert before == pytest.approx(1000 * 0.001 / 10)
    del usage[("chat", "1")]  # unloaded: its 9 busy seconds stay in the window's sum
    assert scrape(collector)[ranker] == pytest.approx(before)
    assert scrape(collector)[chat] == pytest.approx(1000 * 0.009 / 3)
    usage[("chat", "1")] = UsageReading(1.0, 1, 5, llm=True)  # loaded again: counters restart from zero
    clock[0] = 20.0  # $0.02: chat 9 + 1 s, ranker 1 s
    values = scrape(collector)
    assert values[chat] == pytest.approx(1000 * 0.02 * 10 / 11 / 4)
    assert values[ranker] == pytest.approx(1000 * 0.02 * 1 / 11 / 10)
    del usage[("chat", "1")]
    collector.sample()
    clock[0] = 100.0  # the window (60 s) now starts after chat's last use: it drops out
    collector.sample()
    clock[0] = 101.0
    values = scrape(collector)
    assert chat not in values and ("kiln:model_busy_fraction", ("model", "chat"), ("version", "1")) not in values
    assert collector.totals.last.keys() == {("ranker", "1")}
