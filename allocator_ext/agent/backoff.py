"""Reconnection delays: exponential with full jitter, so that many agents of a restarted
sidecar do not all reconnect in the same instant."""

from __future__ import annotations

import random


class Backoff:
    def __init__(self, initial: float = 0.2, maximum: float = 5.0, factor: float = 2.0,
                 rng: random.Random | None = None):
        self.initial = initial
        self.maximum = maximum
        self.factor = factor
        self._ceiling = initial
        self._rng = rng or random.Random()

    def next_delay(self) -> float:
        delay = self._rng.uniform(self._ceiling / 2, self._ceiling)
        self._ceiling = min(self.maximum, self._ceiling * self.factor)
        return delay

    def reset(self) -> None:
        self._ceiling = self.initial
