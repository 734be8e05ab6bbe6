"""Prometheus metrics, created on first use.

prometheus_client picks its storage (in-memory, or the multiprocess mmap files) when it is
first imported, from PROMETHEUS_MULTIPROC_DIR. Nothing here imports it at module level, so
the arbiter can set and wipe that directory before any child touches the library.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge, Histogram

GaugeMode = Literal["livesum", "mostrecent", "max", "livemax", "livemin"]

PREFIX = "outbox_farm_"
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.004,
    0.006,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)
BATCH_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500)


@dataclass(frozen=True)
class Metrics:
    claimed: Counter
    acked: Counter
    retried: Counter
    released: Counter
    terminal: Counter
    dlq_written: Counter
    lease_lost: Counter
    outcome_unconfirmed: Counter
    write_failed: Counter
    handler_seconds: Histogram
    delivery_lag: Histogram
    inflight: Gauge
    fetch_seconds: Histogram
    flush_seconds: Histogram
    flush_batch_size: Histogram
    backlog: Gauge
    oldest_pending_age: Gauge
    xmin_horizon_age: Gauge
    dlq_rows: Gauge
    vacuum_seconds: Histogram
    shrinks: Counter
    shrunk_bytes: Counter
    dlq_purged: Counter
    claim_errors: Counter
    queue_stalled: Gauge
    queue_paused: Gauge
    queue_limit: Gauge
    breaker_open: Gauge
    limited_claims: Counter
    set_aside: Counter


@cache
def metrics() -> Metrics:
    """The process's metric objects (one set per process, in the default registry)."""
    from prometheus_client import Counter, Gauge, Histogram

    def counter(name: str, doc: str, *labels: str) -> Counter:
        return Counter(PREFIX + name, doc, labels)

    def histogram(
        name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...]
    ) -> Histogram:
        return Histogram(PREFIX + name, doc, labels, buckets=buckets)

    def gauge(name: str, doc: str, mode: GaugeMode, *labels: str) -> Gauge:
        return Gauge(PREFIX + name, doc, labels, multiprocess_mode=mode)

    return Metrics(
        claimed=counter("claimed", "Rows claimed (deliveries).", "queue"),
        acked=counter("acked", "Rows deleted after a successful handler run.", "queue"),
        retried=counter("retried", "Rows scheduled for another attempt.", "queue"),
        released=counter("released", "Claimed rows handed back unstarted at stop.", "queue"),
        terminal=counter(
            "terminal", "Rows found to have failed for good, by reason.", "queue", "reason"
        ),
        dlq_written=counter(
            "dlq_written", "Rows archived in the DLQ, by reason.", "queue", "reason"
        ),
        lease_lost=counter(
            "lease_lost",
            "Rows whose lease was taken over (or ran short before the start): nothing written.",
            "queue",
            "phase",
        ),
        outcome_unconfirmed=counter(
            "outcome_unconfirmed",
            "Writes sent again after a lost connection that found their row gone or free: "
            "most likely written by the first attempt.",
            "queue",
            "phase",
        ),
        write_failed=counter(
            "write_failed",
            "Outcomes that could not be written (the row is delivered again), by kind.",
            "kind",
            "queue",
        ),
        handler_seconds=histogram(
            "handler_seconds", "Handler run time.", ("queue",), LATENCY_BUCKETS
        ),
        delivery_lag=histogram(
            "delivery_lag_seconds",
            "From a row's due time to its handler's start.",
            ("queue",),
            LATENCY_BUCKETS,
        ),
        inflight=gauge("inflight", "Rows claimed and not yet completed.", "livesum", "queue"),
        fetch_seconds=histogram(
            "fetch_seconds", "Claim statement time.", ("queue",), LATENCY_BUCKETS
        ),
        flush_seconds=histogram("flush_seconds", "Completer flush time.", (), LATENCY_BUCKETS),
        flush_batch_size=histogram(
            "flush_batch_size", "Outcomes per completer flush.", (), BATCH_BUCKETS
        ),
        backlog=gauge("backlog", "Rows in the outbox table.", "mostrecent", "queue"),
        xmin_horizon_age=gauge(
            "xmin_horizon_age_seconds",
            "How long the oldest open snapshot (or prepared transaction) of the database has "
            "held back VACUUM; 0 when none does.",
            "mostrecent",
        ),
        oldest_pending_age=gauge(
            "oldest_pending_age_seconds",
            "Age of the oldest due row nobody holds.",
            "mostrecent",
            "queue",
        ),
        dlq_rows=gauge(
            "dlq_rows", "Rows in the DLQ table, by failure reason.", "mostrecent", "queue", "reason"
        ),
        vacuum_seconds=histogram(
            "vacuum_seconds", "VACUUMs of the outbox table run by the farm.", (), LATENCY_BUCKETS
        ),
        shrinks=counter(
            "shrinks",
            "Times the farm gave an outbox table's space back after a backlog (or dropped what "
            "a rebuild cut short left).",
        ),
        shrunk_bytes=counter(
            "shrunk_bytes", "Bytes of the outbox table and its indexes those shrinks gave back."
        ),
        dlq_purged=counter(
            "dlq_purged", "DLQ rows deleted by the farm's retention (--dlq-retention).", "queue"
        ),
        claim_errors=counter(
            "claim_errors",
            "Claims that failed, by kind: connection_lost, permanent, refused (any other "
            "database error), internal (an error of outbox_farm itself).",
            "queue",
            "kind",
        ),
        queue_stalled=gauge(
            "queue_stalled",
            "1 while a worker finds the queue stalled (its claims keep failing, or its oldest "
            "ready row ages while the worker is idle), else 0; the highest of the live workers.",
            "livemax",
            "queue",
        ),
        queue_paused=gauge(
            "queue_paused",
            "1 while an operator has paused the queue (no worker claims it; `outbox-farm queue "
            "resume`), else 0; the highest of the live workers, each as its last look found it.",
            "livemax",
            "queue",
        ),
        queue_limit=gauge(
            "queue_limit",
            "The queue's farm-wide limits as the workers apply them (`outbox-farm queue "
            "limit`): `limit` is rate_per_second or max_running; 0 when the queue has no such "
            "limit. The highest of the live workers, each as its last look found it.",
            "livemax",
            "queue",
            "limit",
        ),
        breaker_open=gauge(
            "breaker_open",
            "1 while the queue's breaker is open (its handler kept failing, or said its "
            "downstream is down): no worker claims it but one probe row per interval; else 0. "
            "The highest of the live workers, each as its last look found it.",
            "livemax",
            "queue",
        ),
        limited_claims=counter(
            "limited_claims",
            "Claims the queue's farm-wide limits cut short: its rate's budget or its most "
            "running at once allowed fewer rows than the worker had room for.",
            "queue",
        ),
        set_aside=counter(
            "set_aside",
            "Rows that could be neither loaded nor dead-lettered (no DLQ), parked under the "
            "set-aside token and reported by id (log event row_set_aside).",
            "queue",
        ),
    )


@dataclass(frozen=True)
class RelayMetrics:
    published: Counter
    confirmed: Counter
    nacked: Counter
    returned: Counter
    unconfirmed: Counter
    publish_seconds: Histogram
    batch_size: Histogram
    up: Gauge


@cache
def relay_metrics() -> RelayMetrics:
    """The relays' metrics, by target label; made by the first relay batch of a process."""
    from prometheus_client import Counter, Gauge, Histogram

    def counter(name: str, doc: str) -> Counter:
        return Counter(PREFIX + "relay_" + name, doc, ["target"])

    return RelayMetrics(
        published=counter("published", "Messages sent to the broker (re-sends included)."),
        confirmed=counter("confirmed", "Messages the broker confirmed; their rows are acked."),
        nacked=counter(
            "nacked", "Messages the broker refused (nack, rejected entry, unresolvable route)."
        ),
        returned=counter("returned", "Messages the broker returned as unroutable."),
        unconfirmed=counter(
            "unconfirmed", "Messages whose confirm never came (connection lost, timeout)."
        ),
        publish_seconds=Histogram(
            PREFIX + "relay_publish_seconds",
            "From sending a batch to the last confirm of it.",
            ["target"],
            buckets=LATENCY_BUCKETS,
        ),
        batch_size=Histogram(
            PREFIX + "relay_batch_size",
            "Messages per published batch.",
            ["target"],
            buckets=BATCH_BUCKETS,
        ),
        up=Gauge(
            PREFIX + "relay_up",
            "1 while the relay's broker answers, 0 from a round of sends it answered nothing for "
            "(down, or restarted and forgetting the producer) until it confirms again (the "
            "lowest of the farm's processes).",
            ["target"],
            multiprocess_mode="livemin",
        ),
    )


@dataclass(frozen=True)
class SupervisorMetrics:
    processes: Gauge
    worker_restarts: Counter
    reload_failed: Gauge


@cache
def supervisor_metrics() -> SupervisorMetrics:
    """The arbiter's own metrics; made in the arbiter only, after it set the multiprocess
    directory, so they are not repeated in every worker's files."""
    from prometheus_client import Counter, Gauge

    return SupervisorMetrics(
        processes=Gauge(PREFIX + "processes", "Worker processes running.", multiprocess_mode="max"),
        worker_restarts=Counter(
            PREFIX + "worker_restarts",
            "Worker processes replaced, by why the old one ended: crash (died or was killed), "
            "heartbeat (killed for a blocked event loop), boot (could not boot: exit status 3).",
            ["reason"],
        ),
        reload_failed=Gauge(
            PREFIX + "reload_failed",
            "1 while the workers run older code than the code on disk because the last rolling "
            "restart (HUP, --reload) could not boot the new code, else 0; the next rolling "
            "restart that completes clears it.",
            multiprocess_mode="max",
        ),
    )
