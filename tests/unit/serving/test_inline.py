"""InlineEstimate: which batches run on the event loop thread."""
from kiln.serving.batching.inline import MAX_PROBE_GAP, InlineEstimate

BUDGET = 100_000


def estimate() -> InlineEstimate:
    e = InlineEstimate(budget_ns=BUDGET)
    e.gil_wait_ns = 10_000_000  # two 5 ms switch intervals, whatever the interpreter's setting
    return e


def test_nothing_known_runs_on_the_thread():
    assert not estimate().fits(1)


def test_fast_calls_run_inline_until_the_rows_would_exceed_the_budget():
    e = estimate()
    e.record(rows=1, elapsed_ns=20_000)
    assert e.fits(1) and e.fits(4)
    assert not e.fits(5)  # 5 x 20 us = the budget


def test_one_slow_call_moves_the_next_ones_back_to_the_thread():
    e = estimate()
    for _ in range(10):
        e.record(rows=1, elapsed_ns=10_000)
    e.record(rows=1, elapsed_ns=5_000_000)
    assert not e.fits(1)


def test_a_thread_call_slowed_by_gil_waits_is_probed_inline_and_comes_back():
    e = estimate()
    e.record_thread(rows=16, elapsed_ns=4_000_000, cpu_ns=320_000)  # 4 ms wall, 20 us CPU a row
    assert e._ns_per_row * 4 >= BUDGET  # the wall time alone would keep 4 rows on the thread
    assert e.fits(4) and not e.fits(5)  # a probe, for batches whose CPU time fits
    e.record(rows=4, elapsed_ns=60_000)  # the probe: 15 us a row inline
    assert e.fits(6) and not e.fits(7)  # its wall time is the estimate now


def test_a_model_that_waits_without_the_gil_is_never_probed():
    e = estimate()
    for _ in range(5):
        e.record_thread(rows=1, elapsed_ns=200_000_000, cpu_ns=50_000)  # a 200 ms sleep (or GPU wait)
        assert not e.fits(1)


def test_a_thread_call_whose_cpu_time_exceeds_the_budget_is_not_probed():
    e = estimate()
    e.record_thread(rows=2, elapsed_ns=3_000_000, cpu_ns=240_000)
    assert not e.fits(1)


def test_failed_probes_double_the_thread_calls_between_probes_up_to_the_cap():
    e = estimate()
    gaps = []
    for _ in range(14):
        calls = 0
        while not e.fits(1):
            e.record_thread(rows=1, elapsed_ns=3_000_000, cpu_ns=20_000)
            calls += 1
        gaps.append(calls)
        e.record(rows=1, elapsed_ns=2_000_000)  # the probe: 2 ms inline, over the budget
    assert gaps == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 1024, 1024, 1024]
    assert MAX_PROBE_GAP == 1024
    for _ in range(MAX_PROBE_GAP):
        e.record_thread(rows=1, elapsed_ns=3_000_000, cpu_ns=20_000)
    assert e.fits(1)
    e.record(rows=1, elapsed_ns=30_000)  # a probe that fits: inline from now on, the gap back to one
    assert e.fits(1)
    e.record(rows=1, elapsed_ns=5_000_000)  # slow again: the next thread call is followed by a probe
    assert not e.fits(1)
    e.record_thread(rows=1, elapsed_ns=3_000_000, cpu_ns=20_000)
    assert e.fits(1)
