"""A queue's breaker, as a handler option: when the queue's handler keeps failing, the queue
holds instead of spending its rows' attempts on a downstream that is down.

    @farm.handler("emails", breaker=Breaker(failures=5, probe_every=10))
    async def send(msg): ...

`failures` failed runs in a row, counted across every process and host of the outbox (in the
queue's row of `outbox_farm_queues`), open the breaker; so does one `DownstreamDown` raised by
the handler. Open, it holds the queue on every farm, as a pause does: nothing more is claimed,
and the rows claimed already go back unrun, their attempts and deliveries as they were; a run
that fails beside the ones that opened it keeps its attempts too. Every `probe_every` seconds
one process of one host runs one row, the probe: its success closes the breaker (and every farm
claims the queue again at once); its failure spends that row's attempt, as any failure does, and
the breaker stays open. A run that fails with `DeadLetter` (or under `reject_on_error`) is the
row's fault, not the downstream's, and does not count.

So an outage spends at most `failures` attempts, plus one per probe, whatever the backlog, and
dead-letters nothing that would not have been dead-lettered anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import ConfigurationError


@dataclass(frozen=True, slots=True)
class Breaker:
    """Open after `failures` failed runs in a row; probe with one row every `probe_every`
    seconds while open."""

    failures: int = 5
    probe_every: float = 10.0

    def __post_init__(self) -> None:
        failures = self.failures
        if isinstance(failures, bool) or not isinstance(failures, int) or failures < 1:
            raise ConfigurationError(f"Breaker failures must be a whole number >= 1: {failures!r}")
        every = self.probe_every
        if (
            isinstance(every, bool)
            or not isinstance(every, int | float)
            or not (0 < every < math.inf)
        ):
            raise ConfigurationError(
                f"Breaker probe_every must be a positive number of seconds: {every!r}"
            )
