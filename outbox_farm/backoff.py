"""Jittered exponential backoff for reconnect loops."""

from __future__ import annotations

import random


class Backoff:
    """Delays of first, 2*first, ... up to `cap`, each drawn from [delay/2, delay].

    The jitter keeps many processes that lost the same database from reconnecting in step.
    Owned by one task; `reset()` after a success.
    """

    def __init__(self, first: float = 0.05, cap: float = 5.0) -> None:
        self.first, self.cap = first, cap
        self.failures = 0

    def next(self) -> float:
        delay = min(self.cap, self.first * 2**self.failures)
        self.failures = min(self.failures + 1, 30)
        return random.uniform(delay / 2, delay)

    def reset(self) -> None:
        self.failures = 0
