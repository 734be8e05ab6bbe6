"""Rates from a running farm's /metrics: acked, retried and terminal rows per second, and the
p99 delivery lag, per queue.

The farm's counters only grow; a rate needs two scrapes, so `stats` scrapes, waits a moment
(or, under --watch, uses the previous refresh) and scrapes again. The p99 is read from the
`delivery_lag_seconds` histogram's buckets between the two scrapes (what Prometheus'
`histogram_quantile` over `rate()` computes): the lag of the deliveries made in that window.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field

from ..errors import OutboxFarmError
from ..settings import DEFAULT_BIND

DEFAULT_METRICS_URL = f"http://{DEFAULT_BIND}/metrics"  # where `start` serves by default
PREFIX = "outbox_farm_"
COUNTERS = {"acked": "acked_total", "retried": "retried_total", "terminal": "terminal_total"}
LAG = PREFIX + "delivery_lag_seconds_bucket"


@dataclass(frozen=True)
class Scrape:
    """One reading of /metrics: counter totals and lag buckets by queue, and when."""

    at: float
    totals: dict[tuple[str, str], float] = field(default_factory=dict)  # (counter, queue)
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # queue -> le -> n


@dataclass(frozen=True)
class QueueRates:
    acked: float
    retried: float
    terminal: float
    lag_p99: float | None  # None: no delivery in the window


def scrape(url: str, timeout: float = 5.0) -> Scrape:
    """Read and parse /metrics; OutboxFarmError saying where it failed."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            text = reply.read().decode("utf-8")
    except (OSError, urllib.error.URLError, ValueError) as exc:
        raise OutboxFarmError(
            f"cannot read the farm's metrics at {url}: {exc}; is `outbox-farm start` running "
            "there (see its --metrics-bind)? Pass --metrics-url '' to leave the rates out"
        ) from None
    totals: dict[tuple[str, str], float] = defaultdict(float)
    buckets: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    wanted = {PREFIX + name: key for key, name in COUNTERS.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            queue = sample.labels.get("queue", "")
            if sample.name in wanted:
                totals[(wanted[sample.name], queue)] += sample.value
            elif sample.name == LAG:
                buckets[queue][float(sample.labels["le"])] += sample.value
    return Scrape(time.monotonic(), dict(totals), {q: dict(b) for q, b in buckets.items()})


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """`histogram_quantile` over cumulative bucket counts (le -> count); None when empty."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower  # beyond the last finite bucket: its bound is all that is known
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def rates(before: Scrape, after: Scrape) -> dict[str, QueueRates]:
    """Per-queue rates between two scrapes (a restarted farm's reset counters read as 0)."""
    seconds = max(after.at - before.at, 1e-6)
    queues = {queue for _, queue in after.totals} | set(after.buckets)

    def rate(key: str, queue: str) -> float:
        delta = after.totals.get((key, queue), 0.0) - before.totals.get((key, queue), 0.0)
        return max(delta, 0.0) / seconds

    result = {}
    for queue in sorted(queues):
        old = before.buckets.get(queue, {})
        window = {le: n - old.get(le, 0.0) for le, n in after.buckets.get(queue, {}).items()}
        result[queue] = QueueRates(
            rate("acked", queue),
            rate("retried", queue),
            rate("terminal", queue),
            quantile(0.99, window),
        )
    return result
