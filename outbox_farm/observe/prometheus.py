"""The metrics observer: every event as a Prometheus sample, in this process's registry (the
multiprocess one under the farm, merged at the arbiter's /metrics).

Label children are looked up once per queue and kept: a labelled metric's `labels()` takes a
lock and builds a key on every call, and the per-message events come thousands of times a
second. For the same reason the two per-message histograms (delivery lag, handler run time)
are tallied here in plain lists and added to their Prometheus children at most FLUSH_EVERY
seconds later, in one go, and at the runtime's stop: under the multiprocess registry every
`observe()` is two locked writes to a shared file, which cost more than the handling of a
message itself. Counts stay exact; a scrape sees an observation up to FLUSH_EVERY late.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_right
from typing import TYPE_CHECKING

from ..message import Message
from ..metrics import RelayMetrics, metrics, relay_metrics
from ..outcome import Kind, Outcome
from .base import Observer, report_failure

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge, Histogram

CLAIM_ERROR_KINDS = ("connection_lost", "permanent", "refused", "internal")
FLUSH_EVERY = 0.25  # seconds an observation may wait in a tally
# Read once: an Enum member read off its class costs 0.1 µs (Python 3.11), and `decided` runs
# for every message.
_TERMINAL, _EXPIRE = Kind.TERMINAL, Kind.EXPIRE


class Tally:
    """A histogram child's observations, kept in this process and added to the child by
    `flush()`: the same buckets, count and sum as had each been observed on its own (the sum
    added in another order, so equal up to float rounding).

    An observation is one append to `values` (written out in the observer's events): the
    buckets are counted at the flush, over the sorted values, a binary search per bound
    rather than one per value. Reaches into the child's bucket and sum values:
    prometheus_client offers no call that adds n observations to one bucket.
    `tests/unit/test_metrics_tally.py` holds the two ways equal.
    """

    __slots__ = ("bounds", "child", "values")

    def __init__(self, child: Histogram) -> None:
        self.child = child
        self.bounds: list[float] = list(child._upper_bounds)
        self.values: list[float] = []  # observed since the last flush

    def flush(self) -> None:
        values = self.values
        if not values:
            return
        self.values = []
        total = sum(values)
        if total != total:  # a NaN (or infinities of both signs): NaN reaches no bucket
            values = [value for value in values if value == value]
        values.sort()
        child, below = self.child, 0
        for i, bound in enumerate(self.bounds):
            upto = bisect_right(values, bound)  # `value <= bound`, as Histogram.observe
            if upto > below:
                child._buckets[i].inc(upto - below)
                below = upto
        child._sum.inc(total)


class _Queue:
    """One queue's label children of the per-message metrics."""

    __slots__ = ("claimed", "fetch_seconds", "handler_seconds", "inflight", "lag")

    def __init__(self, queue: str) -> None:
        m = metrics()
        self.claimed: Counter = m.claimed.labels(queue)
        self.fetch_seconds: Histogram = m.fetch_seconds.labels(queue)
        self.inflight: Gauge = m.inflight.labels(queue)
        self.lag = Tally(m.delivery_lag.labels(queue))
        self.handler_seconds = Tally(m.handler_seconds.labels(queue))


class PrometheusObserver(Observer):
    _guarded = frozenset({"handler_started", "handler_finished", "decided"})

    def __init__(self) -> None:
        self.m = metrics()
        self._queues: dict[str, _Queue] = {}
        self._dirty: list[Tally] = []  # tallies holding observations not yet flushed
        self._flush_at: asyncio.TimerHandle | None = None
        self._reported: set[tuple[int, str]] = set()  # failures of the guarded events logged
        self._written = {"ack": self.m.acked, "retry": self.m.retried, "release": self.m.released}
        self._relay: RelayMetrics | None = None  # made by the first relay event of the process

    def _add_queue(self, queue: str) -> _Queue:
        children = self._queues[queue] = _Queue(queue)
        return children

    def _tallied(self) -> None:
        """An observation was tallied: make sure a flush follows within FLUSH_EVERY."""
        if self._flush_at is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # outside an event loop (a relay's or a test's direct call)
            self.flush()
            return
        self._flush_at = loop.call_later(FLUSH_EVERY, self.flush)

    def flush(self) -> None:
        """Add every tallied observation to its Prometheus histogram."""
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        dirty, self._dirty = self._dirty, []
        for n, tally in enumerate(dirty):
            try:
                tally.flush()
            except BaseException:
                # The tallies not reached keep their values: back in the list, or they would
                # never be flushed again (a tally registers only as its first value comes).
                self._dirty.extend(dirty[n + 1 :])
                raise

    def serving(self, queues: list[str]) -> None:
        """Every queue's series exist from the start, at zero: a dashboard's rate() or an
        alert on a counter that never moved would otherwise see no series at all."""
        for queue in queues:
            self._add_queue(queue)
            for phase in ("start", "heartbeat"):
                self.m.lease_lost.labels(queue, phase)
            self.m.queue_stalled.labels(queue).set(0)
            for kind in CLAIM_ERROR_KINDS:
                self.m.claim_errors.labels(queue, kind)

    def claimed(self, queue: str, rows: int, seconds: float) -> None:
        children = self._queues.get(queue) or self._add_queue(queue)
        children.fetch_seconds.observe(seconds)
        if rows:
            children.claimed.inc(rows)

    def held(self, queue: str, delta: int) -> None:
        (self._queues.get(queue) or self._add_queue(queue)).inflight.inc(delta)

    # The three per-message events guard themselves (see `Observer._guarded`). The first two
    # add their value to a tally, written out in each: a call less per message. The first
    # value since a flush registers its tally and makes sure a flush follows (`_first`).

    def handler_started(self, msg: Message, lag: float) -> None:
        try:
            tally = (self._queues.get(msg.queue) or self._add_queue(msg.queue)).lag
            values = tally.values
            values.append(lag)
            if len(values) == 1:
                self._first(tally)
        except Exception:
            report_failure(self, "handler_started", self._reported)

    def handler_finished(self, queue: str, seconds: float) -> None:
        try:
            tally = (self._queues.get(queue) or self._add_queue(queue)).handler_seconds
            values = tally.values
            values.append(seconds)
            if len(values) == 1:
                self._first(tally)
        except Exception:
            report_failure(self, "handler_finished", self._reported)

    def _first(self, tally: Tally) -> None:
        """`tally` holds a value again: it is flushed with the others."""
        self._dirty.append(tally)
        if self._flush_at is None:
            self._tallied()

    def stopped(self) -> None:
        self.flush()

    def decided(self, msg: Message, outcome: Outcome) -> None:
        try:
            kind = outcome.kind
            if kind is _TERMINAL:
                self.m.terminal.labels(outcome.queue, str(outcome.reason)).inc()
            elif kind is _EXPIRE:
                self.m.lease_lost.labels(outcome.queue, "start").inc()
        except Exception:
            report_failure(self, "decided", self._reported)

    def lease_lost(self, phase: str, queue: str, row_id: int, deliveries: int | None) -> None:
        self.m.lease_lost.labels(queue, phase).inc()

    def written(self, phase: str, queue: str, rows: int) -> None:
        counter = self._written.get(phase)
        if counter is not None:
            counter.labels(queue).inc(rows)

    def dead_lettered(self, outcome: Outcome) -> None:
        self.m.dlq_written.labels(outcome.queue, str(outcome.reason)).inc()

    def outcome_unconfirmed(self, phase: str, outcome: Outcome) -> None:
        self.m.outcome_unconfirmed.labels(outcome.queue, phase).inc()

    def write_failed(self, kind: str, queue: str, rows: int) -> None:
        self.m.write_failed.labels(kind, queue).inc(rows)

    def flushed(self, seconds: float, size: int) -> None:
        self.m.flush_seconds.observe(seconds)
        self.m.flush_batch_size.observe(size)

    def claim_failed(self, queue: str, kind: str) -> None:
        self.m.claim_errors.labels(queue, kind).inc()

    def stalled(self, queue: str, reason: str | None) -> None:
        self.m.queue_stalled.labels(queue).set(0 if reason is None else 1)

    def _relays(self) -> RelayMetrics:
        if self._relay is None:
            self._relay = relay_metrics()
        return self._relay

    def relay_sent(self, target: str, rows: int, seconds: float) -> None:
        m = self._relays()
        m.publish_seconds.labels(target).observe(seconds)
        m.batch_size.labels(target).observe(rows)
        m.published.labels(target).inc(rows)

    def relay_settled(self, target: str, outcome: str, rows: int) -> None:
        getattr(self._relays(), outcome).labels(target).inc(rows)

    def relay_connection(self, target: str, up: bool) -> None:
        self._relays().up.labels(target).set(1 if up else 0)
