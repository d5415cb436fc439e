"""InlineEstimate: which batches run on the event loop thread."""
from kiln.serving.batching.inline import InlineEstimate


def test_nothing_known_runs_on_the_thread():
    assert not InlineEstimate(budget_ns=100_000).fits(1)


def test_fast_calls_run_inline_until_the_rows_would_exceed_the_budget():
    estimate = InlineEstimate(budget_ns=100_000)
    estimate.record(rows=1, elapsed_ns=20_000)
    assert estimate.fits(1) and estimate.fits(4)
    assert not estimate.fits(5)  # 5 x 20 us = the budget


def test_one_slow_call_moves_the_next_ones_back_to_the_thread():
    estimate = InlineEstimate(budget_ns=100_000)
    for _ in range(10):
        estimate.record(rows=1, elapsed_ns=10_000)
    estimate.record(rows=1, elapsed_ns=5_000_000)
    assert not estimate.fits(1)
    estimate.record(rows=1, elapsed_ns=10_000)  # fast again: the average comes down over several calls
    assert not estimate.fits(1)
