"""Weighted rendezvous hashing: the split matches the weights, keys stick,
and a weight change moves only the keys it must."""

import math
import random

import pytest

from kiln.dataplane.routing.chooser import WeightedChooser, unit_hash

N = 20_000
KEYS = [f"user-{i}" for i in range(N)]


def within_binomial(count: int, n: int, p: float, sigmas: float = 4.5) -> bool:
    """|count - np| within `sigmas` standard deviations of Binomial(n, p)."""
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


def assignment(weights: dict[str, float]) -> dict[str, str]:
    chooser = WeightedChooser(weights)
    return {k: chooser.choose(k) for k in KEYS}


def test_unit_hash_is_uniform_in_the_open_interval():
    values = [unit_hash(k, "t") for k in KEYS]
    assert all(0 < v < 1 for v in values)
    below_tenth = sum(v < 0.1 for v in values)
    assert within_binomial(below_tenth, N, 0.1)


@pytest.mark.parametrize("weights", [{"a": 90, "b": 10}, {"a": 50, "b": 30, "c": 20}, {"a": 1, "b": 1, "c": 1, "d": 7}])
def test_keyed_split_matches_the_weights_within_a_binomial_bound(weights):
    chosen = assignment(weights)
    total = sum(weights.values())
    for target, weight in weights.items():
        count = sum(1 for t in chosen.values() if t == target)
        assert within_binomial(count, N, weight / total), (target, count)


def test_keyless_draws_match_the_weights_within_a_binomial_bound():
    chooser = WeightedChooser({"a": 70, "b": 20, "c": 10}, random.Random(7))
    draws = [chooser.choose(None) for _ in range(N)]
    for target, p in (("a", 0.7), ("b", 0.2), ("c", 0.1)):
        assert within_binomial(draws.count(target), N, p), target


def test_a_key_sticks_to_its_target_while_the_weights_stand():
    weights = {"smollm2@1": 90, "smollm2@2": 10}
    first = assignment(weights)
    again = WeightedChooser(dict(reversed(list(weights.items()))))  # a new chooser, same weights
    assert all(again.choose(k) == t for k, t in first.items())
    chooser = WeightedChooser(weights)
    assert all(chooser.choose(k) == first[k] for k in KEYS[:1000] for _ in range(3))


def test_raising_one_weight_moves_keys_only_to_that_target_and_only_as_many_as_needed():
    before = assignment({"a": 90, "b": 10})
    after = assignment({"a": 80, "b": 20})
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(before[k] == "a" and after[k] == "b" for k in moved)
    assert within_binomial(len(moved), N, 0.2 - 0.1)  # exactly the share that had to move


def test_lowering_one_weight_moves_keys_only_away_from_that_target():
    before = assignment({"a": 50, "b": 30, "c": 20})
    after = assignment({"a": 50, "b": 30, "c": 5})
    moved = [k for k in KEYS if before[k] != after[k]]
    assert moved and all(before[k] == "c" for k in moved)
    # c keeps 5/85 of the traffic: 20% - 5.88% of all keys had to move
    assert within_binomial(len(moved), N, 0.2 - 5 / 85)


def test_adding_a_target_takes_keys_from_every_other_target_and_none_move_between_them():
    before = assignment({"a": 60, "b": 40})
    after = assignment({"a": 60, "b": 40, "c": 25})
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == "c" for k in moved)
    assert within_binomial(len(moved), N, 25 / 125)


def test_a_zero_weight_target_gets_nothing():
    chooser = WeightedChooser({"a": 1, "b": 0})
    assert {chooser.choose(k) for k in KEYS[:2000]} == {"a"}
    with pytest.raises(ValueError):
        WeightedChooser({"a": 0})
