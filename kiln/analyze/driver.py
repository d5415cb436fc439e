"""Measuring configurations on real servers: the search's `evaluate`.

One `kiln serve` runs at a time. By default it is started once, with the
first configuration, and switched to each later one through the
model-control API; `fresh=True` starts a new server for every configuration
instead (clean memory figures, slower). Points already in the result store
are not measured again, and a server is started only when a point is
missing. A configuration the server refuses is recorded as not servable.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kiln.analyze.load import Workload, measure_level
from kiln.analyze.objective import Objective, Point
from kiln.analyze.progress import Progress, StopFlag
from kiln.analyze.search import Interrupted
from kiln.analyze.server import LoadFailed, ServerProcess
from kiln.analyze.space import Config, config_key
from kiln.analyze.store import ResultStore
from kiln.analyze.subject import Subject
from kiln.analyze.sweep import ConfigResult, sweep


class Measurer:
    def __init__(
        self,
        subject: Subject,
        workload: Workload,
        objective: Objective,
        store: ResultStore,
        workdir: Path,
        stop: StopFlag,
        progress: Progress,
        price_per_hour: float | None = None,
        fresh: bool = False,
        measure_level: Callable[..., Point] = measure_level,
    ):
        self.subject, self.workload, self.objective, self.store = subject, workload, objective, store
        self.workdir, self.stop, self.progress = workdir, stop, progress
        self.price_per_hour, self.fresh = price_per_hour, fresh
        self._measure_level = measure_level
        self.server: ServerProcess | None = None
        self.serving: str | None = None  # config_key of the configuration the server serves
        self.servers_started = 0

    def evaluate(self, config: Config) -> ConfigResult:
        key = config_key(config)
        reason = self.store.invalid.get(key) or self.subject.problem(config)
        if reason is not None:
            if key not in self.store.invalid:
                self.store.add_invalid(config, reason)
            self.progress.config_done(config, None, reason, len(self.workload.levels))
            return ConfigResult(config, invalid=reason, stop_reason="not servable")
        points: list[Point] = []

        def measure(cfg: Config, level: float) -> Point:
            point = self.store.get(cfg, level)
            cached = point is not None
            if point is None:
                if self.stop.requested:
                    raise Interrupted
                self._serve(cfg)
                point = self._measure_level(self.server, self.subject.name, self.workload, level,
                                            self.price_per_hour)
                self.store.add(cfg, point)
            points.append(point)
            self.progress.point(cfg, point, self.objective, cached)
            return point

        try:
            result = sweep(config, list(self.workload.levels), measure, self.objective)
        except Interrupted:
            raise Interrupted(ConfigResult(config, points=points, stop_reason="interrupted")) from None
        except LoadFailed as exc:
            self.store.add_invalid(config, str(exc))
            result = ConfigResult(config, invalid=str(exc), stop_reason="not servable")
        self.progress.config_done(config, result, result.invalid or None,
                                  len(self.workload.levels) - len(result.points))
        return result

    def _serve(self, config: Config) -> None:
        key = config_key(config)
        if self.server is not None and self.serving == key:
            return
        if self.server is not None and self.fresh:
            self.close()
        if self.server is None:
            self.workdir.mkdir(parents=True, exist_ok=True)
            self.progress.note(f"starting kiln serve ({self.subject.name})")
            self.server = ServerProcess(self._serve_args(config), self.workdir / "server.log",
                                        grpc=self.workload.protocol == "grpc")
            self.servers_started += 1
            self.serving = None
            self.server.wait_started(self.subject.name)  # LoadFailed: this configuration does not load
        else:
            self.progress.note("switching configuration")
            self.server.load(self.subject.name, self.subject.load_config(config))
        self.server.settle_memory()
        self.serving = key

    def _serve_args(self, config: Config) -> list[str]:
        args = self.subject.serve_args(config, self.workdir)
        if self.price_per_hour is not None:
            # a short cost window: the gauge then covers little more than the level just measured
            window = max(1.0, self.workload.duration_s)
            args += ["--price-per-hour", str(self.price_per_hour), "--cost-window-s", str(window)]
        return args

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.server, self.serving = None, None
