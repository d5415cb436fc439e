"""CPU utilisation of a process over the window: CPU seconds / (span * its cores)."""

import os
import time

import pytest

from kiln.metrics.process import ProcessCollector


def burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_utilisation_is_cpu_time_over_span_times_cores():
    clock = [0.0]
    collector = ProcessCollector(lambda: {("m", "api"): os.getpid()}, window_s=60.0, clock=lambda: clock[0])
    collector.sample()
    before = time.process_time()
    burn(0.3)
    used = time.process_time() - before
    clock[0] = 2.0  # pretend the window spans 2 s
    cores = len(os.sched_getaffinity(0))
    (key, fraction), = collector.utilisation().items()
    assert key == ("m", "api", os.getpid())
    # CPU times tick in 10 ms; this process's other threads may add a little
    assert (used - 0.02) / (2.0 * cores) <= fraction <= (used + 0.2) / (2.0 * cores)
    names = {f.name for f in collector.collect()}
    assert "kiln:process_cpu_utilisation" in names


def test_a_window_shorter_than_a_second_reports_nothing():
    clock = [0.0]
    collector = ProcessCollector(lambda: {("m", "api"): os.getpid()}, window_s=60.0, clock=lambda: clock[0])
    collector.sample()
    clock[0] = 0.5
    assert collector.utilisation() == {}
    with pytest.raises(ValueError):
        ProcessCollector(lambda: {}, window_s=0)
