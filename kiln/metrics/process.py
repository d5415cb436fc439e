"""CPU and memory of the server's processes (API and engine), read at scrape.

A custom collector, so the numbers are read when Prometheus asks and the
engine process (whose pid the API side learns at start) is included.

CPU utilisation is the fraction of the cores a process may run on (its CPU
affinity) that it used over the sliding window: delta(CPU seconds) /
(window span * cores). `sample()` (called periodically by the data plane)
keeps the window's snapshots.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kiln.metrics.window import SlidingWindow

# (model_name, process role) -> pid (None while unknown, e.g. an engine before it is ready)
PidSource = Callable[[], dict[tuple[str, str], int | None]]
MIN_SPAN_S = 1.0  # a shorter window says nothing about utilisation


class ProcessCollector(Collector):
    def __init__(self, pids: PidSource, window_s: float = 300.0, clock: Callable[[], float] = time.monotonic):
        self.pids = pids
        self.clock = clock
        self.window = SlidingWindow(window_s)
        self._procs: dict[int, psutil.Process] = {}
        self._cores: dict[int, int] = {}

    def sample(self) -> None:
        self.window.add(self.clock(), self._cpu_seconds())

    def _cpu_seconds(self) -> dict:
        out = {}
        for (model_name, role), pid in self.pids().items():
            proc = self._process(pid)
            if proc is None or pid is None:
                continue
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            out[(model_name, role, pid)] = (times.user + times.system,)
        return out

    def utilisation(self) -> dict[tuple[str, str, int], float]:
        """(model_name, role, pid) -> fraction of its cores used over the window."""
        span, deltas = self.window.deltas(self.clock(), self._cpu_seconds())
        if span < MIN_SPAN_S:
            return {}
        return {key: cpu[0] / (span * self._num_cores(key[2])) for key, cpu in deltas.items()}

    def collect(self) -> Iterator:
        cpu = CounterMetricFamily(
            "kiln:process_cpu_seconds", "CPU time used (user + system).", labels=["model_name", "process"]
        )
        rss = GaugeMetricFamily(
            "kiln:process_resident_memory_bytes", "Resident memory.", labels=["model_name", "process"]
        )
        threads = GaugeMetricFamily("kiln:process_threads", "Threads.", labels=["model_name", "process"])
        util = GaugeMetricFamily(
            "kiln:process_cpu_utilisation",
            "Fraction of the process's cores (its CPU affinity) it used over the cost window (0-1).",
            labels=["model_name", "process"],
        )
        for (model_name, role), pid in self.pids().items():
            proc = self._process(pid)
            if proc is None:
                continue
            try:
                with proc.oneshot():
                    times, mem, nthreads = proc.cpu_times(), proc.memory_info(), proc.num_threads()
            except psutil.Error:
                continue
            labels = [model_name, role]
            cpu.add_metric(labels, times.user + times.system)
            rss.add_metric(labels, mem.rss)
            threads.add_metric(labels, nthreads)
        for (model_name, role, _pid), fraction in sorted(self.utilisation().items()):
            util.add_metric([model_name, role], fraction)
        yield from (cpu, rss, threads, util)

    def _num_cores(self, pid: int) -> int:
        if pid not in self._cores:
            try:
                self._cores[pid] = len(os.sched_getaffinity(pid)) or 1
            except (AttributeError, OSError):
                self._cores[pid] = psutil.cpu_count() or 1
        return self._cores[pid]

    def _process(self, pid: int | None) -> psutil.Process | None:
        if pid is None:
            return None
        if pid not in self._procs:
            try:
                self._procs[pid] = psutil.Process(pid)
            except psutil.Error:
                return None
        return self._procs[pid]
