"""The queues' table of a `memory.MemoryStore`, as `outbox_farm_queues` holds it for Postgres:
the operator's pauses and limits, the rate bucket a limit fills, and the breaker the farms trip,
each queue's in its own row.

Its own module because it is a table of its own beside the outbox: written by the operator's
commands and by the breakers, read by every limited claim and by `controls`, and sharing no
row with the outbox and DLQ that `memory_table` keeps. Not locked: its store holds its lock
around every call, and sends the wake-ups a change calls for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime

from ..breaker import Breaker
from ..limits import Limits, Rate, allowance
from ..storage import QueueControl, Tripped
from .memory_rows import after


@dataclass(slots=True)
class BreakerRow:
    """A queue's breaker, as its columns of `outbox_farm_queues` keep it."""

    failures: int = 0
    open_since: datetime | None = None
    probe_at: datetime | None = None
    reason: str | None = None


class Queues:
    """The rows of one store's queues' table, by queue."""

    def __init__(self) -> None:
        self.paused: dict[str, QueueControl] = {}
        self.limits: dict[str, Limits] = {}
        self.buckets: dict[str, tuple[float, float]] = {}  # queue: tokens left, when (clock)
        self.breakers: dict[str, BreakerRow] = {}

    def pause(self, queue: str, until: datetime | None, reason: str | None) -> None:
        self.paused[queue] = QueueControl(queue, True, until, reason)

    def resume(self, queue: str) -> None:
        self.paused.pop(queue, None)

    def limit(self, queue: str, limits: Limits) -> None:
        """`limits` in place of the queue's (`Limits()`: none): a new rate starts with a full
        bucket."""
        if limits:
            if limits.rate != self.limits.get(queue, Limits()).rate:
                self.buckets.pop(queue, None)
            self.limits[queue] = limits
        else:
            self.limits.pop(queue, None)
            self.buckets.pop(queue, None)

    def allowance(
        self, queue: str, want: int, running: Callable[[], int], at: float
    ) -> tuple[int, float, float | None]:
        """How many of `want` rows the queue's limits let a claim take at `at` (the store's
        clock), and the seconds until they may let it take more (`limits.allowance`), the rows
        `running` now counted only against a `max_running`; and the rate's bucket refilled to
        `at` (None without a rate), which `spend` takes the claimed rows from."""
        limits = self.limits.get(queue, Limits())
        room = None if limits.max_running is None else limits.max_running - running()
        rate = limits.rate
        tokens = None if rate is None else self._refilled(queue, rate, at)
        allowed, wait = allowance(
            want,
            tokens=tokens,
            per_second=rate.per_second if rate else None,
            size=rate.burst if rate else None,
            room=room,
        )
        return allowed, wait, tokens

    def spend(self, queue: str, tokens: float | None, taken: int, at: float) -> None:
        """Keep the bucket `allowance` refilled to `at`, less the `taken` rows."""
        if tokens is not None:
            self.buckets[queue] = (tokens - taken, at)

    def _refilled(self, queue: str, rate: Rate, at: float) -> float:
        left, then = self.buckets.get(queue, (rate.burst, at))
        return min(rate.burst, left + rate.per_second * max(at - then, 0.0))

    def breaker_failed(
        self, queue: str, breaker: Breaker, reason: str, down: bool, now: datetime
    ) -> tuple[bool, bool]:
        """A failure counted: whether it opened the breaker (at the threshold, or at once when
        `down`, the first probe `probe_every` seconds on), and whether it is open."""
        row = self.breakers.setdefault(queue, BreakerRow())
        if row.open_since is not None:
            return False, True
        row.failures += 1
        if not down and row.failures < breaker.failures:
            return False, False
        row.open_since, row.reason = now, reason
        row.probe_at = after(now, breaker.probe_every)
        return True, True

    def breaker_reset(self, queue: str) -> None:
        row = self.breakers.get(queue)
        if row is not None and row.open_since is None:
            row.failures = 0

    def breaker_probe(self, queue: str, every: float, now: datetime) -> bool:
        row = self.breakers.get(queue)
        if row is None or row.open_since is None or row.probe_at is None:
            return False
        if row.probe_at > now:
            return False
        row.probe_at = after(now, every)
        return True

    def breaker_close(self, queue: str) -> bool:
        row = self.breakers.get(queue)
        if row is None or row.open_since is None:
            return False
        self.breakers[queue] = BreakerRow()
        return True

    def controls(self, now: datetime) -> dict[str, QueueControl]:
        """Each queue paused (its `paused_until` not yet past at `now`), limited, or with a
        breaker counting or open, with all three."""
        paused = {
            queue: control
            for queue, control in self.paused.items()
            if control.paused_until is None or control.paused_until > now
        }
        breakers = {q: row for q, row in self.breakers.items() if row.failures or row.open_since}
        found = {}
        for queue in sorted({*paused, *self.limits, *breakers}):
            control = paused.get(queue, QueueControl(queue, False))
            row = breakers.get(queue, BreakerRow())
            tripped = None
            if row.open_since is not None and row.probe_at is not None:
                probe_in = (row.probe_at - now).total_seconds()
                tripped = Tripped(row.open_since, probe_in, row.reason)
            limits = self.limits.get(queue, Limits())
            found[queue] = replace(control, limits=limits, tripped=tripped, failures=row.failures)
        return found
