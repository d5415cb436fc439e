"""Searching the configuration space without sweeping the whole grid.

`coordinate_search` (the default) starts from the base configuration and
tunes one parameter at a time, holding the others at their best values so
far. An ordered parameter is walked outward from its current value, first
upwards and, if the first step up did not help, downwards; a direction stops
at the first value that does not beat the best configuration so far by
`min_gain` (2%): throughput is assumed to rise and then fall along one
parameter, so nothing beyond that value is measured. An unordered parameter
tries each value. A pass over every parameter repeats (at most `max_passes`)
while some parameter changed. That is about the sum, not the product, of the
parameters' value counts.

`optuna_search` asks optuna's TPE sampler (seeded, so a run is repeatable)
for `trials` configurations, the base configuration first.

Both keep the base configuration unless another beats it by `min_gain`, so
measurement noise never changes the recommendation on its own. Both take the
measurement as a function (`evaluate`): the tests give them a fake one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kiln.analyze.space import Config, Param, SearchSpace, Value, config_key
from kiln.analyze.sweep import ConfigResult

MIN_GAIN = 0.02


class Interrupted(Exception):
    """Raised by a measurement when the user asked the run to stop; carries what was measured of the sweep."""

    def __init__(self, partial: ConfigResult | None = None):
        super().__init__("interrupted")
        self.partial = partial


class BudgetExhausted(Exception):
    pass


@dataclass
class SearchOutcome:
    results: list[ConfigResult] = field(default_factory=list)  # in the order they were evaluated
    base: ConfigResult | None = None
    best: ConfigResult | None = None
    trace: list[str] = field(default_factory=list)  # the decisions, for the report
    stopped: str = ""  # "interrupted", "budget", or "" when the search finished


def better(candidate: ConfigResult, incumbent: ConfigResult | None, min_gain: float) -> bool:
    if incumbent is None:
        return True
    return candidate.score > incumbent.score * (1 + min_gain) and candidate.score > 0


class Evaluations:
    """Memoised evaluation, in order, under an optional budget of distinct configurations."""

    def __init__(self, evaluate: Callable[[Config], ConfigResult], max_configs: int | None, outcome: SearchOutcome):
        self.evaluate = evaluate
        self.max_configs = max_configs
        self.outcome = outcome
        self.done: dict[str, ConfigResult] = {}

    def __call__(self, config: Config) -> ConfigResult:
        key = config_key(config)
        if key in self.done:
            return self.done[key]
        if self.max_configs is not None and len(self.done) >= self.max_configs:
            raise BudgetExhausted
        try:
            result = self.evaluate(config)
        except Interrupted as stop:
            if stop.partial is not None and stop.partial.points:
                stop.partial.complete = False
                self.outcome.results.append(stop.partial)
            raise
        self.done[key] = result
        self.outcome.results.append(result)
        return result


def _describe(name: str, value: Value, result: ConfigResult) -> str:
    if result.invalid:
        return f"{name}={value}: not servable ({result.invalid})"
    return f"{name}={value}: {result.score:.1f}"


def _line_search(
    param: Param, current: Config, best: ConfigResult, measure: Evaluations, min_gain: float, trace: list[str]
) -> ConfigResult:
    start = param.values.index(current[param.name])
    for step in (1, -1):
        index, moved = start + step, False
        while 0 <= index < len(param.values):
            candidate = measure({**current, param.name: param.values[index]})
            trace.append(f"  tried {_describe(param.name, param.values[index], candidate)}")
            if not better(candidate, best, min_gain):
                break
            best, moved = candidate, True
            index += step
        if moved:
            break
    return best


def _try_all(
    param: Param, current: Config, best: ConfigResult, measure: Evaluations, min_gain: float, trace: list[str]
) -> ConfigResult:
    for value in param.values:
        if value == current[param.name]:
            continue
        candidate = measure({**current, param.name: value})
        trace.append(f"  tried {_describe(param.name, value, candidate)}")
        if better(candidate, best, min_gain):
            best = candidate
    return best


def coordinate_search(
    space: SearchSpace,
    evaluate: Callable[[Config], ConfigResult],
    min_gain: float = MIN_GAIN,
    max_passes: int = 2,
    max_configs: int | None = None,
    outcome: SearchOutcome | None = None,
) -> SearchOutcome:
    """`outcome` (optional) is filled as the search goes: the caller keeps it if the search is cut short."""
    outcome = outcome if outcome is not None else SearchOutcome()
    measure = Evaluations(evaluate, max_configs, outcome)
    try:
        best = outcome.base = measure(dict(space.base))
        outcome.trace.append(f"base: {best.score:.1f}")
        for number in range(1, max_passes + 1):
            changed = False
            for param in space.params:
                if len(param.values) < 2:
                    continue
                current = dict(best.config)
                outcome.trace.append(f"pass {number}, {param.name} (now {current[param.name]}):")
                walk = _line_search if param.ordered else _try_all
                best = walk(param, current, best, measure, min_gain, outcome.trace)
                if best.config[param.name] != current[param.name]:
                    changed = True
                    outcome.trace.append(f"  -> {param.name}={best.config[param.name]} ({best.score:.1f})")
            if not changed:
                break
    except Interrupted:
        outcome.stopped = "interrupted"
    except BudgetExhausted:
        outcome.stopped = "budget"
    outcome.best = choose_best(outcome, min_gain)
    return outcome


def optuna_search(
    space: SearchSpace,
    evaluate: Callable[[Config], ConfigResult],
    trials: int,
    seed: int = 0,
    min_gain: float = MIN_GAIN,
    max_configs: int | None = None,
    outcome: SearchOutcome | None = None,
) -> SearchOutcome:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    outcome = outcome if outcome is not None else SearchOutcome()
    measure = Evaluations(evaluate, max_configs, outcome)
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(5, max(1, trials // 3)))
    study = optuna.create_study(direction="maximize", sampler=sampler)
    study.enqueue_trial(dict(space.base))
    try:
        for number in range(trials):
            trial = study.ask()
            config = {p.name: trial.suggest_categorical(p.name, list(p.values)) for p in space.params}
            config = {**space.base, **config}
            result = measure(config)
            if outcome.base is None:
                outcome.base = result
            study.tell(trial, result.score)
            outcome.trace.append(f"trial {number}: {config_key(config)} -> {result.score:.1f}")
    except Interrupted:
        outcome.stopped = "interrupted"
    except BudgetExhausted:
        outcome.stopped = "budget"
    outcome.best = choose_best(outcome, min_gain)
    return outcome


def choose_best(outcome: SearchOutcome, min_gain: float) -> ConfigResult | None:
    """The highest-scoring complete result, unless it does not beat the base by `min_gain`."""
    feasible = [r for r in outcome.results if r.complete and not r.invalid and r.score > 0]
    if not feasible:
        return None
    top = max(feasible, key=lambda r: r.score)  # the first of equals: evaluation order
    base = outcome.base
    if base is not None and any(r is base for r in feasible) and not better(top, base, min_gain):
        return base
    return top
