"""A queue's farm-wide limits, as an operator states them and as the farms apply them.

A rate is kept as it was given (`6000/min` reads back as `6000/min`, not `100/s`), and applied
as a token bucket refilled continuously at `per_second`, shared by every process and host
through the queue's row of `outbox_farm_queues`. The bucket holds at most `burst` tokens: a
tenth of a second's worth (two at least), so a queue idle for an hour starts again at its rate,
not with an hour's worth at once, and no one-second window ever sees more than the rate plus a
tenth of it (plus two rows, under 20 a second). A claim takes at most what the bucket holds; a
claim that finds fewer rows than it was allowed leaves the rest in the bucket.

A claim held back by the rate waits until the bucket is half full, not full: a bucket that is
full stops filling, so a claim that comes late (a busy machine, a slow round trip) would lose
the time it took, and the rate seen would fall short of the limit by as much.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

BURST_SECONDS = 0.1
"""The bucket's size, in seconds of the rate: how far a burst may run ahead of it."""
BURST_LEAST = 2.0
"""The smallest bucket, in tokens: room for a claim that comes late beside the one it waits for."""

_UNITS = {
    "s": 1.0,
    "sec": 1.0,
    "second": 1.0,
    "m": 60.0,
    "min": 60.0,
    "minute": 60.0,
    "h": 3600.0,
    "hour": 3600.0,
    "d": 86400.0,
    "day": 86400.0,
}
_NAMES = {1.0: "s", 60.0: "min", 3600.0: "h", 86400.0: "day"}
_RATE = re.compile(r"^\s*(\d+)\s*/\s*(\d*\.?\d*)\s*([a-z]+?)s?\s*$")


@dataclass(frozen=True, slots=True)
class Rate:
    """`count` rows per `seconds`."""

    count: int
    seconds: float

    def __post_init__(self) -> None:
        if self.count < 1 or not (0 < self.seconds < math.inf):
            raise ValueError(f"a rate needs a count of 1 or more per a positive time: {self}")

    @property
    def per_second(self) -> float:
        return self.count / self.seconds

    @property
    def burst(self) -> float:
        """The most tokens the bucket holds (see the module)."""
        return max(BURST_LEAST, self.per_second * BURST_SECONDS)

    def __str__(self) -> str:
        unit = _NAMES.get(self.seconds)
        return f"{self.count}/{unit}" if unit else f"{self.count}/{self.seconds:g}s"


def parse_rate(text: str) -> Rate:
    """`100/s`, `6000/min`, `50/h`, `1000/day`, `5/10s`: a count, a slash, an optional number
    and a unit (s, sec, second, m, min, minute, h, hour, d, day; a plural s is allowed)."""
    found = _RATE.match(text.lower())
    unit = _UNITS.get(found.group(3)) if found else None
    if found is None or unit is None:
        raise ValueError(
            f"not a rate: {text!r}; write a count per a unit of time, such as 100/s, "
            "6000/min, 50/h or 5/10s"
        )
    many = float(found.group(2)) if found.group(2) else 1.0
    if not many > 0:
        raise ValueError(f"not a rate: {text!r}; the time it is counted over must be positive")
    count = int(found.group(1))
    if count < 1 or count > 2**31 - 1:
        raise ValueError(f"not a rate: {text!r}; the count must be from 1 to 2147483647")
    return Rate(count, many * unit)


@dataclass(frozen=True, slots=True)
class Limits:
    """What a queue may run, farm-wide: at most `rate`, at most `max_running` at once
    (leased rows, from their claim until their outcome is written), and at most
    `key_max_running` at once of each fair key (a tenant: `publish(..., fair_key=...)`; the
    rows without one count as one key of their own). None: no such limit."""

    rate: Rate | None = None
    max_running: int | None = None
    key_max_running: int | None = None

    def __bool__(self) -> bool:
        return (
            self.rate is not None
            or self.max_running is not None
            or self.key_max_running is not None
        )

    def __str__(self) -> str:
        parts = []
        if self.rate is not None:
            parts.append(f"rate {self.rate}")
        if self.max_running is not None:
            parts.append(f"at most {self.max_running} running")
        if self.key_max_running is not None:
            parts.append(f"at most {self.key_max_running} running per fair key")
        return ", ".join(parts) or "no limits"


ROOM_POLL = 0.05
"""Seconds a claim held back by `max_running` waits before it asks again: the rows that free
the room are acked by other processes, which tell nobody."""


def allowance(
    want: int,
    *,
    tokens: float | None,
    per_second: float | None,
    size: float | None,
    room: int | None,
) -> tuple[int, float]:
    """How many of `want` rows a claim may take now, and after how many seconds asking again
    is worth it (0: at once). `tokens`, `per_second`, `size`: the rate's bucket as refilled
    now, None when there is no rate; `room`: rows that may start before `max_running` is
    reached, None when there is no such limit.

    A claim held back by the rate waits until the bucket holds a claim's worth (`want`, or half
    the bucket when smaller: see the module), so a limited queue is claimed in a few larger
    claims rather than one row at a time; one held back by `max_running` asks again after
    `ROOM_POLL`."""
    allowed, wait = want, 0.0
    if room is not None and room < want:
        allowed = max(room, 0)
        wait = ROOM_POLL
    if tokens is not None and per_second is not None and size is not None:
        whole = int(tokens + 1e-9)  # a float a hair under an integer still pays for it
        if whole < allowed:
            allowed = whole
        need = max(1.0, min(float(want), size / 2))
        if tokens + 1e-9 < need:
            wait = max(wait, (need - tokens) / per_second)
    return allowed, wait
