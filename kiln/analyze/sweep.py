"""One configuration under increasing load, stopped early.

The levels (concurrencies or request rates) are measured in increasing
order. The sweep stops at the first level outside the SLOs, or once
throughput has risen by less than `min_rise` (5%) over the best level so far
at two consecutive levels: the configuration is saturated, and more load
only adds latency. The configuration's score is its best throughput among
the levels inside the SLOs (0 when there is none).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kiln.analyze.objective import Objective, Point
from kiln.analyze.space import Config

MIN_RISE = 0.05
FLAT_LEVELS = 2


@dataclass
class ConfigResult:
    config: Config
    points: list[Point] = field(default_factory=list)
    best: Point | None = None  # the level with the highest throughput inside the SLOs
    score: float = 0.0  # the objective's throughput at `best`
    stop_reason: str = ""
    invalid: str = ""  # why the configuration could not be served at all
    complete: bool = True  # False when the run was interrupted during this sweep

    @property
    def feasible(self) -> bool:
        return self.best is not None


def sweep(
    config: Config,
    levels: list[float],
    measure: Callable[[Config, float], Point],
    objective: Objective,
    min_rise: float = MIN_RISE,
) -> ConfigResult:
    result = ConfigResult(config)
    flat = 0
    for level in levels:
        point = measure(config, level)
        result.points.append(point)
        broken = objective.violation(point)
        if broken is not None:
            result.stop_reason = f"SLO broken at {level:g}: {broken}"
            break
        throughput = objective.throughput(point)
        flat = flat + 1 if result.best is not None and throughput < result.score * (1 + min_rise) else 0
        if result.best is None or throughput > result.score:
            result.best, result.score = point, throughput
        if flat >= FLAT_LEVELS:
            result.stop_reason = f"throughput rose < {min_rise:.0%} at {FLAT_LEVELS} levels in a row (at {level:g})"
            break
    else:
        result.stop_reason = "all levels measured"
    return result
