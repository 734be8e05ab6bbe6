"""The metrics observer: every event as a Prometheus sample, in this process's registry (the
multiprocess one under the farm, merged at the arbiter's /metrics).

Label children are looked up once per queue and kept: a labelled metric's `labels()` takes a
lock and builds a key on every call, and the per-message events come thousands of times a
second.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..message import Message
from ..metrics import RelayMetrics, metrics, relay_metrics
from ..outcome import Kind, Outcome
from .base import Observer

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge, Histogram

CLAIM_ERROR_KINDS = ("connection_lost", "permanent", "refused", "internal")


class _Queue:
    """One queue's label children of the per-message metrics."""

    __slots__ = ("claimed", "fetch_seconds", "handler_seconds", "inflight", "lag")

    def __init__(self, queue: str) -> None:
        m = metrics()
        self.claimed: Counter = m.claimed.labels(queue)
        self.fetch_seconds: Histogram = m.fetch_seconds.labels(queue)
        self.inflight: Gauge = m.inflight.labels(queue)
        self.lag: Histogram = m.delivery_lag.labels(queue)
        self.handler_seconds: Histogram = m.handler_seconds.labels(queue)


class PrometheusObserver(Observer):
    def __init__(self) -> None:
        self.m = metrics()
        self._queues: dict[str, _Queue] = {}
        self._written = {"ack": self.m.acked, "retry": self.m.retried, "release": self.m.released}
        self._relay: RelayMetrics | None = None  # made by the first relay event of the process

    def _add_queue(self, queue: str) -> _Queue:
        children = self._queues[queue] = _Queue(queue)
        return children

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

    def handler_started(self, msg: Message, lag: float) -> None:
        (self._queues.get(msg.queue) or self._add_queue(msg.queue)).lag.observe(lag)

    def handler_finished(self, queue: str, seconds: float) -> None:
        (self._queues.get(queue) or self._add_queue(queue)).handler_seconds.observe(seconds)

    def decided(self, msg: Message, outcome: Outcome) -> None:
        if outcome.kind is Kind.TERMINAL:
            self.m.terminal.labels(outcome.queue, str(outcome.reason)).inc()
        elif outcome.kind is Kind.EXPIRE:
            self.m.lease_lost.labels(outcome.queue, "start").inc()

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
