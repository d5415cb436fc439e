"""The load sweep's stopping rule, against a fake measurement."""

from __future__ import annotations

from kiln.analyze.objective import Objective, Point, cost_per_1k
from kiln.analyze.sweep import sweep

LEVELS = [1, 2, 4, 8, 16, 32]


def fake(throughput_cap: float, latency_per_level_ms: float = 1.0, errors_at: float | None = None):
    measured = []

    def measure(config, level):
        measured.append(level)
        return Point(level=level, requests=100, inferences_per_s=min(level * 100.0, throughput_cap),
                     p99_ms=level * latency_per_level_ms, errors=1 if level == errors_at else 0,
                     first_error="HTTP 503" if level == errors_at else "")

    return measure, measured


def test_stops_after_two_levels_that_rise_less_than_five_percent():
    measure, measured = fake(throughput_cap=350.0)
    result = sweep({}, LEVELS, measure, Objective("repository"))
    assert measured == [1, 2, 4, 8, 16]  # 350, 350, 350: flat twice after level 4
    assert result.best.level == 4 and result.score == 350.0
    assert "rose < 5% at 2 levels in a row" in result.stop_reason


def test_a_small_rise_counts_as_flat_and_a_big_one_resets():
    values = {1: 100.0, 2: 104.0, 4: 150.0, 8: 155.0, 16: 160.0, 32: 400.0}
    measured = []

    def measure(config, level):
        measured.append(level)
        return Point(level=level, requests=10, inferences_per_s=values[level])

    result = sweep({}, LEVELS, measure, Objective("repository"))
    # 104 < 105: flat once; 150 resets; 155 < 157.5: flat once; 160 < 162.75 (5% over 155): flat twice, stop
    assert measured == [1, 2, 4, 8, 16]
    assert result.best.level == 16 and result.score == 160.0


def test_stops_at_the_first_level_outside_the_slo():
    measure, measured = fake(throughput_cap=10_000.0, latency_per_level_ms=2.0)
    result = sweep({}, LEVELS, measure, Objective("repository", max_p99_latency_ms=10.0))
    assert measured == [1, 2, 4, 8]  # 16 ms at 8 breaks the 10 ms SLO
    assert result.best.level == 4 and result.score == 400.0
    assert result.stop_reason.startswith("SLO broken at 8: p99 latency 16.0 ms > 10 ms")


def test_failed_requests_break_the_slo():
    measure, measured = fake(throughput_cap=10_000.0, errors_at=2)
    result = sweep({}, LEVELS, measure, Objective("repository"))
    assert measured == [1, 2] and result.best.level == 1
    assert "1 failed requests (HTTP 503)" in result.stop_reason


def test_no_level_in_slo_scores_zero():
    measure, _ = fake(throughput_cap=1000.0, latency_per_level_ms=50.0)
    result = sweep({}, LEVELS, measure, Objective("repository", max_p99_latency_ms=10.0))
    assert result.best is None and result.score == 0.0 and not result.feasible


def test_llm_objective_is_output_tokens_under_ttft_and_tpot():
    objective = Objective("llm", max_p99_ttft_ms=500, max_p99_tpot_ms=50)
    ok = Point(level=1, requests=8, output_tokens_per_s=120.0, ttft_p99_ms=400, tpot_p99_ms=49)
    assert objective.violation(ok) is None and objective.throughput(ok) == 120.0
    slow_first = Point(level=1, requests=8, ttft_p99_ms=501, tpot_p99_ms=1)
    slow_next = Point(level=1, requests=8, ttft_p99_ms=1, tpot_p99_ms=51)
    assert objective.violation(slow_first) == "p99 TTFT 501.0 ms > 500 ms"
    assert objective.violation(slow_next) == "p99 TPOT 51.0 ms > 50 ms"
    assert objective.violation(Point(level=1)) == "no request completed"


def test_cost_per_thousand_predictions():
    assert cost_per_1k(3.6, 10.0) == 0.1  # $3.60/h = $0.001/s; 100 s for 1,000 predictions
    assert cost_per_1k(None, 10.0) is None and cost_per_1k(1.0, 0.0) is None
