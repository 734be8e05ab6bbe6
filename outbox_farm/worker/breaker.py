"""A queue's breaker in one runtime (see `outbox_farm.breaker` for what a user sees): the
executors ask it what a run's outcome becomes, the fetcher asks it for the probes, and the
controls' watcher tells it whether the breaker is open farm-wide.

The count lives in the store (`Store.breaker_failed`), so it is exact across processes: a
failure is sent there only while the breaker is closed, and a success only while failures are
counted (this runtime counted one, or its last look at the controls found some): the common
case, a queue whose runs succeed, costs nothing. A store out of reach counts nothing: the run's
outcome is written as it would be without a breaker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

from .. import decision
from ..breaker import Breaker
from ..decision import QUIET, Notes
from ..errors import DatabaseError, DeadLetter, DownstreamDown
from ..message import Message
from ..metrics import metrics
from ..outcome import Kind, Outcome, Reason, exception_line
from ..storage import Store, Tripped

log = logging.getLogger("outbox_farm.breaker")


def describe(queue: str, tripped: Tripped) -> str:
    """One line for logs, /healthz and the console."""
    why = f": {tripped.reason}" if tripped.reason else ""
    return f"queue {queue} breaker open since {tripped.since.isoformat()}{why}"


class QueueBreaker:
    """The breaker of one queue (`breaker`, its settings), over `store`."""

    def __init__(self, queue: str, breaker: Breaker, store: Store) -> None:
        self.queue = queue
        self.breaker = breaker
        self.store = store
        self.tripped: Tripped | None = None  # open farm-wide, as last known here
        self.counting = False  # failures are counted farm-wide: a success resets them
        self.probes: set[int] = set()  # ids of the rows claimed as probes, until they end
        self.probe_at = 0.0  # monotonic time the next probe may run, as last known here
        self.wake: Callable[[], None] = _nothing  # the fetcher's wake (`runtime`)

    def holds(self, msg: Message) -> bool:
        """Whether a row taken from the inbox must go back unrun: the breaker is open and the
        row is not its probe."""
        return self.tripped is not None and msg.id not in self.probes

    def concerns(self, msg: Message, exc: BaseException | None) -> bool:
        """Whether a run's outcome is the breaker's business (`settle`): a failure, a probe,
        or any run while the breaker is open or counting. A plain success of a closed breaker
        that counts nothing is not: the common case costs this test alone."""
        return (
            exc is not None
            or self.tripped is not None
            or self.counting
            or (bool(self.probes) and msg.id in self.probes)
        )

    def known(self, tripped: Tripped | None, failures: int) -> bool:
        """What the controls' last load says: open or not, and failures counted. True when it
        opened or closed since the load before."""
        changed = (tripped is None) != (self.tripped is None)
        self.tripped = tripped
        if tripped is not None:
            self.probe_at = time.monotonic() + tripped.probe_in
        self.counting = self.counting or failures > 0
        metrics().breaker_open.labels(self.queue).set(0 if tripped is None else 1)
        return changed

    def probed(self, won: bool) -> None:
        """A probe's turn was asked for (`won` or not): the next is one interval on, or
        sooner if the controls' next load says so."""
        self.probe_at = time.monotonic() + self.breaker.probe_every

    async def settle(
        self, msg: Message, exc: BaseException | None, outcome: Outcome, notes: Notes
    ) -> tuple[Outcome, Notes]:
        """The outcome of a run that ended with `outcome`, and what to log: a success closes
        an open breaker or resets the count; a failure the downstream may be to blame for is
        counted, and goes back with its attempts kept when it fails beside an open breaker."""
        probe = msg.id in self.probes
        self.probes.discard(msg.id)
        if outcome.kind is Kind.ACK:
            await self._succeeded(probe)
            return outcome, notes
        if exc is None or not _counts(exc, outcome):
            return outcome, notes
        if probe:
            log.info(
                "probe of queue %s failed (%s); breaker stays open, next probe in %gs",
                self.queue,
                exception_line(exc),
                self.breaker.probe_every,
                extra={"event": "breaker_probe_failed", "queue": self.queue, "row_id": msg.id},
            )
            return outcome, notes
        if self.tripped is not None:
            return decision.released(msg), QUIET
        down = isinstance(exc, DownstreamDown)
        why = "the handler said the downstream is down" if down else None
        opened, open_ = await self._failed(exception_line(exc), down=down, why=why)
        if open_ and not opened:
            return decision.released(msg), QUIET
        return outcome, notes

    async def trip(self, reason: str) -> None:
        """Open the breaker now, for a cause outside any row (a relay's broker out of reach);
        nothing when it is open already."""
        if self.tripped is None:
            await self._failed(reason, down=True, why="its downstream is out of reach")

    async def _failed(self, reason: str, *, down: bool, why: str | None) -> tuple[bool, bool]:
        """Count a failure (`down`: open at once) farm-wide; (opened by it, open now). A store
        out of reach counts nothing: (False, False)."""
        try:
            opened, open_ = await self.store.breaker_failed(
                self.queue, self.breaker, reason, down=down
            )
        except DatabaseError as error:
            log.debug("breaker of queue %s: failure not counted (%s)", self.queue, error)
            return False, False
        self.counting = True
        if open_ and self.tripped is None:  # here at once; the controls' load says it later
            self.known(Tripped(datetime.now(UTC), self.breaker.probe_every, reason), 0)
        if opened:
            log.warning(
                "breaker of queue %s opened: %s (%s); the queue holds on every farm, one row "
                "probes every %gs, and the rows keep their attempts",
                self.queue,
                why or f"{self.breaker.failures} failures in a row",
                reason,
                self.breaker.probe_every,
                extra={"event": "breaker_opened", "queue": self.queue},
            )
        return opened, open_

    async def _succeeded(self, probe: bool) -> None:
        if not (probe or self.tripped is not None or self.counting):
            return
        try:
            if probe or self.tripped is not None:
                if await self.store.breaker_close(self.queue):
                    log.warning(
                        "breaker of queue %s closed: a run succeeded; every farm claims it again",
                        self.queue,
                        extra={"event": "breaker_closed", "queue": self.queue},
                    )
                # Closed here at once, not at the controls' next load: the rows this process
                # took before it opened run now, in their order, not after newer ones.
                self.known(None, 0)
                self.wake()
            else:
                await self.store.breaker_reset(self.queue)
            self.counting = False
        except DatabaseError as error:
            log.debug("breaker of queue %s: success not recorded (%s)", self.queue, error)


def _nothing() -> None:
    """No fetcher to wake."""


def _counts(exc: BaseException, outcome: Outcome) -> bool:
    """Whether a failed run counts toward the breaker: not a row the handler gave up on
    itself (`DeadLetter`, `reject_on_error`), which is the row's fault, not the downstream's."""
    if isinstance(exc, DeadLetter) or outcome.reason is Reason.REJECTED:
        return False
    return outcome.kind in (Kind.RETRY, Kind.TERMINAL)
