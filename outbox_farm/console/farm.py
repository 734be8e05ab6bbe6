"""What the running farm says about itself, read over HTTP from its /metrics and /healthz, and
the last 15 minutes of it kept in this process.

The farm keeps no history: its counters only grow. A `Sampler` reads /metrics every few
seconds and keeps each reading for `HISTORY` seconds, so the overview can show rates and a
chart without Prometheus; the rates and the p99 lag between two readings are computed by
`admin.rates`, as `outbox-farm stats` computes them. A farm that cannot be reached is a
message on the page, never an error of the page: the database's numbers are still shown.
The history starts when the console starts (it is in memory only).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..admin.rates import COUNTERS, LAG, PREFIX, QueueRates, Scrape, rates
from ..dsn import scrub

log = logging.getLogger("outbox_farm.console")
HISTORY = 15 * 60.0  # seconds of readings kept for the chart
TIMEOUT = 3.0  # seconds one read of /metrics or /healthz may take


class Unreachable(Exception):
    """The farm did not answer; the message says where and why."""


def _fetch(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT) as reply:
            return int(reply.status), reply.read()
    except urllib.error.HTTPError as exc:  # /healthz answers 503 with a body when unhealthy
        return exc.code, exc.read()
    except (OSError, ValueError) as exc:
        raise Unreachable(f"cannot read {url}: {scrub(str(exc))}") from None


def healthz_url(metrics_url: str) -> str:
    """/healthz beside the given /metrics (the farm serves both on one address)."""
    parts = urllib.parse.urlsplit(metrics_url)
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, "/healthz", "", ""))


@dataclass(frozen=True)
class Reading:
    """One reading of /metrics: what `admin.rates` needs, and the farm-wide figures."""

    scrape: Scrape
    wall: float  # time.time() of the reading, for the chart's axis
    processes: float | None = None
    restarts: dict[str, float] = field(default_factory=dict)  # by reason
    relays_up: dict[str, bool] = field(default_factory=dict)  # by target
    xmin_horizon_age: float | None = None
    queues: frozenset[str] = frozenset()  # every queue the farm's metrics name


def parse_metrics(text: str, at: float, wall: float) -> Reading:
    """A reading from the exposition text (the farm's merged multiprocess metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[tuple[str, str], float] = defaultdict(float)
    buckets: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    wanted = {PREFIX + name: key for key, name in COUNTERS.items()}
    restarts: dict[str, float] = defaultdict(float)
    relays: dict[str, bool] = {}
    processes = xmin = None
    queues: set[str] = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels = sample.name, sample.labels
            if "queue" in labels:
                queues.add(labels["queue"])
            if name in wanted:
                totals[(wanted[name], labels.get("queue", ""))] += sample.value
            elif name == LAG:
                buckets[labels.get("queue", "")][float(labels["le"])] += sample.value
            elif name == PREFIX + "processes":
                processes = sample.value
            elif name == PREFIX + "worker_restarts_total":
                restarts[labels.get("reason", "")] += sample.value
            elif name == PREFIX + "relay_up":
                relays[labels.get("target", "")] = sample.value >= 1
            elif name == PREFIX + "xmin_horizon_age_seconds":
                xmin = sample.value
    scrape = Scrape(at, dict(totals), {q: dict(b) for q, b in buckets.items()})
    return Reading(scrape, wall, processes, dict(restarts), relays, xmin, frozenset(queues))


def read_metrics(url: str) -> Reading:
    status, body = _fetch(url)
    if status != 200:
        raise Unreachable(f"{url} answered {status}")
    return parse_metrics(body.decode("utf-8", "replace"), time.monotonic(), time.time())


@dataclass(frozen=True)
class Health:
    status: int
    detail: dict[str, Any]

    @property
    def healthy(self) -> bool:
        return self.status == 200

    @property
    def problems(self) -> list[str]:
        problems = self.detail.get("problems", [])
        return [str(p) for p in problems] if isinstance(problems, list) else [str(problems)]


def read_health(metrics_url: str) -> Health:
    url = healthz_url(metrics_url)
    status, body = _fetch(url)
    try:
        detail = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise Unreachable(f"{url} answered {status} with no JSON: is it a farm?") from None
    return Health(status, detail if isinstance(detail, dict) else {"answer": detail})


@dataclass(frozen=True)
class Point:
    """The farm's rates between two readings, summed over queues, for the chart."""

    wall: float
    acked: float
    retried: float
    terminal: float


@dataclass
class FarmView:
    """What the pages show of the farm: the latest rates, or why there are none."""

    url: str | None
    error: str | None = None
    latest: Reading | None = None
    queues: dict[str, QueueRates] = field(default_factory=dict)
    window: float | None = None  # seconds between the two readings the rates are from
    points: list[Point] = field(default_factory=list)


class Sampler:
    """Reads /metrics every `every` seconds while the console runs; owns the history.

    Written by its own task (`run`), read by the request handlers on the same event loop: no
    lock is needed, and a reader never sees a half-made reading.
    """

    def __init__(self, url: str | None, every: float) -> None:
        self.url = url or None
        self.every = every
        self.readings: deque[Reading] = deque()
        self.error: str | None = None if url else "no --metrics-url given"

    async def run(self) -> None:
        """Sample until cancelled. A failed read is remembered as the error to show; nothing
        else can end the loop (an unexpected exception is logged and the loop goes on)."""
        if self.url is None:
            return
        while True:
            await self.sample()
            await asyncio.sleep(self.every)

    async def sample(self) -> None:
        assert self.url is not None
        try:
            reading = await asyncio.to_thread(read_metrics, self.url)
        except Unreachable as exc:
            self.error = str(exc)
            return
        except Exception:
            log.exception("reading the farm's metrics failed", extra={"event": "console_sample"})
            self.error = "reading the farm's metrics failed (see the console's log)"
            return
        if self.readings and reading.scrape.at - self.readings[-1].scrape.at <= 0:
            return
        self.error = None
        self.readings.append(reading)
        while self.readings and reading.scrape.at - self.readings[0].scrape.at > HISTORY:
            self.readings.popleft()

    def view(self) -> FarmView:
        view = FarmView(self.url, self.error)
        history = list(self.readings)
        if history:
            view.latest = history[-1]
        if len(history) >= 2:
            before, after = history[-2], history[-1]
            view.queues = rates(before.scrape, after.scrape)
            view.window = after.scrape.at - before.scrape.at
        for before, after in itertools.pairwise(history):
            each = rates(before.scrape, after.scrape).values()
            view.points.append(
                Point(
                    after.wall,
                    sum(r.acked for r in each),
                    sum(r.retried for r in each),
                    sum(r.terminal for r in each),
                )
            )
        return view
