"""The search against a fake, deterministic measurement: exact configurations measured, exact choice."""

from __future__ import annotations

import pytest

from kiln.analyze.search import Interrupted, SearchOutcome, coordinate_search, optuna_search
from kiln.analyze.space import Param, SearchSpace
from kiln.analyze.sweep import ConfigResult

BATCH = {4: 100, 8: 200, 16: 300, 32: 400, 64: 350}  # rises, then falls
DELAY = {0: 0, 1: 30, 2: 20, 5: -50}
MODE = {"a": 0, "b": 100, "c": -500}

SPACE = SearchSpace(
    "repository",
    (Param("batch", (4, 8, 16, 32, 64), True, ""), Param("delay", (0, 1, 2, 5), True, ""),
     Param("mode", ("a", "b", "c"), False, "")),
    {"batch": 16, "delay": 2, "mode": "a"},
)


class Fake:
    """score = BATCH + DELAY + MODE; records what it was asked to measure."""

    def __init__(self, interrupt_at: int | None = None):
        self.calls: list[tuple] = []
        self.interrupt_at = interrupt_at

    def __call__(self, config: dict) -> ConfigResult:
        if self.interrupt_at is not None and len(self.calls) == self.interrupt_at:
            raise Interrupted(ConfigResult(config, points=[object()]))  # type: ignore[list-item]
        self.calls.append((config["batch"], config["delay"], config["mode"]))
        score = BATCH[config["batch"]] + DELAY[config["delay"]] + MODE[config["mode"]]
        return ConfigResult(dict(config), score=max(0.0, float(score)), best=object())  # type: ignore[arg-type]


def test_coordinate_search_measures_a_line_per_parameter_and_picks_the_optimum():
    fake = Fake()
    outcome = coordinate_search(SPACE, fake, min_gain=0.02, max_passes=2)
    assert fake.calls == [
        (16, 2, "a"),  # base: 320
        (32, 2, "a"), (64, 2, "a"),  # batch up: 420 wins, 370 stops the walk (no walk down after a win)
        (32, 5, "a"), (32, 1, "a"), (32, 0, "a"),  # delay: up 350 stops; down 430 wins, 400 stops
        (32, 1, "b"), (32, 1, "c"),  # mode: every value; b wins (530)
        (64, 1, "b"), (16, 1, "b"),  # pass 2: nothing beats 530 by 2% ...
        (32, 2, "b"), (32, 0, "b"),  # ... and (32, 1, a|c) come from the memo
    ]
    assert outcome.best.config == {"batch": 32, "delay": 1, "mode": "b"}
    assert outcome.base.config == SPACE.base
    assert outcome.stopped == ""
    assert len(outcome.results) == 12 and SPACE.size() == 60


def test_a_gain_under_min_gain_keeps_the_base():
    space = SearchSpace("repository", (Param("batch", (16, 32), True, ""),), {"batch": 16})

    def evaluate(config):
        return ConfigResult(config, score=100.0 if config["batch"] == 16 else 101.5, best=object())

    outcome = coordinate_search(space, evaluate, min_gain=0.02)
    assert outcome.best.config == {"batch": 16}  # +1.5% is noise
    outcome = coordinate_search(space, evaluate, min_gain=0.01)
    assert outcome.best.config == {"batch": 32}


def test_budget_stops_the_search_with_the_best_so_far():
    fake = Fake()
    outcome = coordinate_search(SPACE, fake, max_configs=3)
    assert fake.calls == [(16, 2, "a"), (32, 2, "a"), (64, 2, "a")]
    assert outcome.stopped == "budget"
    assert outcome.best.config == {"batch": 32, "delay": 2, "mode": "a"}


def test_interrupt_keeps_what_was_measured():
    fake = Fake(interrupt_at=4)
    outcome = SearchOutcome()
    coordinate_search(SPACE, fake, outcome=outcome)
    assert outcome.stopped == "interrupted"
    assert [r.complete for r in outcome.results] == [True, True, True, True, False]  # the partial sweep is kept
    assert outcome.results[-1].config == {"batch": 32, "delay": 1, "mode": "a"}
    assert outcome.best.config == {"batch": 32, "delay": 2, "mode": "a"}  # only complete sweeps compete


def test_an_unservable_base_loses_to_any_servable_configuration():
    space = SearchSpace("repository", (Param("batch", (16, 32), True, ""),), {"batch": 16})

    def evaluate(config):
        if config["batch"] == 16:
            return ConfigResult(config, invalid="does not load")
        return ConfigResult(config, score=5.0, best=object())

    assert coordinate_search(space, evaluate).best.config == {"batch": 32}


def test_nothing_feasible_recommends_nothing():
    outcome = coordinate_search(SPACE, lambda config: ConfigResult(config, score=0.0))
    assert outcome.best is None


def test_optuna_search_is_seeded_and_starts_from_the_base():
    pytest.importorskip("optuna")
    runs = []
    for _ in range(2):
        fake = Fake()
        outcome = optuna_search(SPACE, fake, trials=15, seed=3)
        runs.append((fake.calls, outcome.best.config))
    assert runs[0] == runs[1]
    calls, best = runs[0]
    assert calls[0] == (16, 2, "a")
    assert len(calls) <= 15 and len(set(calls)) == len(calls)  # repeats come from the memo
    top = max(calls, key=lambda c: BATCH[c[0]] + DELAY[c[1]] + MODE[c[2]])
    assert (best["batch"], best["delay"], best["mode"]) == top
