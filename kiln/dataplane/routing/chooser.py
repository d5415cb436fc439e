"""Weighted rendezvous (highest random weight) hashing.

A request with key k goes to the target t that maximises
`w_t / -ln(u(k, t))`, where u(k, t) in (0, 1) is a hash of the pair. Then
P(t) = w_t / sum(w) over keys, a key's target depends only on the weights,
and changing one target's weight moves only keys to or from that target:
no key moves between two targets whose weights stood (minimal disruption).
Requests without a key are drawn at random with the same probabilities.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Mapping

_SCALE = 2.0**64


def unit_hash(key: str, target: str) -> float:
    """A uniform number in (0, 1) fixed by (key, target)."""
    digest = hashlib.blake2b(f"{key}\x00{target}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 0.5) / _SCALE


class WeightedChooser:
    """Immutable: a weight change builds a new chooser."""

    def __init__(self, weights: Mapping[str, float], rng: random.Random | None = None):
        self.weights = {t: float(w) for t, w in weights.items() if w > 0}
        if not self.weights:
            raise ValueError("a chooser needs at least one target with a positive weight")
        self._targets = sorted(self.weights)
        self._cumulative = list(_running_sum(self.weights[t] for t in self._targets))
        self._rng = rng or random.Random()

    def choose(self, key: str | None) -> str:
        if key is None:
            return self._draw()
        return max(self._targets, key=lambda t: self.weights[t] / -math.log(unit_hash(key, t)))

    def _draw(self) -> str:
        point = self._rng.random() * self._cumulative[-1]
        for target, bound in zip(self._targets, self._cumulative, strict=True):
            if point < bound:
                return target
        return self._targets[-1]


def _running_sum(values) -> list[float]:
    total, out = 0.0, []
    for v in values:
        total += v
        out.append(total)
    return out
