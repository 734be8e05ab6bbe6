"""What the running farm says about itself, read over HTTP from its /metrics and /healthz, and
the last 15 minutes of it kept in this process.

The farm keeps no history: its counters only grow. A `Sampler` reads /metrics every few
seconds; it keeps the last two readings whole, for the rates and the p99 lag by queue between
them (computed by `admin.rates`, as `outbox-farm stats` computes them, once per reading), and
of the older ones only their farm-wide rates, one point each for `HISTORY` seconds, so the
overview can show a chart without Prometheus. Whatever the number of queues a farm names, the
console holds two readings of them, not fifteen minutes'. A label longer than a queue name can
be (`MAX_QUEUE`) names no queue of this farm and is not kept. A farm that cannot be reached is a
message on the page, never an error of the page: the database's numbers are still shown.
The history starts when the console starts (it is in memory only).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import logging
import socket
import threading
import time
import urllib.parse
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..admin.dlq import MAX_QUEUE
from ..admin.rates import COUNTERS, LAG, PREFIX, QueueRates, Scrape, rates
from ..dsn import scrub

log = logging.getLogger("outbox_farm.console")
HISTORY = 15 * 60.0  # seconds of readings kept for the chart
TIMEOUT = 3.0  # seconds one whole read of /metrics or /healthz may take, connect to last byte
BODY_CAP = 1 << 20  # bytes: a farm's /metrics is a few KiB; more is not a farm


class Unreachable(Exception):
    """The farm did not answer; the message says where and why."""


def shown(url: str) -> str:
    """`url` without its user and password, as pages and logs show it."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


class _Deadline:
    """Cuts a connection's socket when the whole read has taken `seconds`: a per-read socket
    timeout alone lets a server that trickles a byte every second hold a read for ever."""

    def __init__(self, conn: http.client.HTTPConnection, seconds: float) -> None:
        self.conn = conn
        self.passed = False
        self._timer = threading.Timer(seconds, self._cut)
        self._timer.daemon = True

    def _cut(self) -> None:
        self.passed = True
        sock = self.conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a recv() blocked in another thread

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
        self.conn.close()


def _fetch(url: str, timeout: float = TIMEOUT, cap: int = BODY_CAP) -> tuple[int, bytes]:
    """(status, body) of a GET of `url`, the whole exchange within `timeout` seconds and the
    body at most `cap` bytes; Unreachable otherwise. Blocking: run it in a thread."""
    where = shown(url)
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Unreachable(f"{where} is not an http(s) URL")
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    try:
        conn = kind(parts.hostname, parts.port, timeout=timeout)
    except ValueError as exc:
        raise Unreachable(f"cannot read {where}: {exc}") from None
    headers = {"Accept": "text/plain, application/json"}
    if parts.username is not None:
        user, password = parts.username, parts.password or ""
        pair = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}"
        headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
    path = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
    with _Deadline(conn, timeout) as deadline:
        try:
            conn.request("GET", path, headers=headers)
            body = bytearray()
            with conn.getresponse() as reply:  # closed, or its socket outlives the connection
                status = int(reply.status)
                while chunk := reply.read1(min(65536, cap + 1 - len(body))):
                    body += chunk
                    if len(body) > cap:
                        raise Unreachable(
                            f"{where} answered more than {cap:,} bytes: is it a farm?"
                        )
        except (OSError, ValueError, http.client.HTTPException) as exc:
            if deadline.passed:
                raise Unreachable(f"{where} did not answer within {timeout:g}s") from None
            why = scrub(str(exc)) or type(exc).__name__
            raise Unreachable(f"cannot read {where}: {why}") from None
        if deadline.passed:  # cut between two reads: the body may be incomplete
            raise Unreachable(f"{where} did not answer within {timeout:g}s")
        return status, bytes(body)


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
                if len(labels["queue"]) > MAX_QUEUE:
                    continue
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


def read_metrics(url: str, timeout: float = TIMEOUT) -> Reading:
    """One reading of the farm's /metrics at `url`, within `timeout` seconds; Unreachable
    when it does not answer 200 in time (or answers more than `BODY_CAP` bytes). Blocking:
    only the `Sampler` calls it, in a thread of its own, never a request handler."""
    status, body = _fetch(url, timeout)
    if status != 200:
        raise Unreachable(f"{shown(url)} answered {status}")
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


def read_health(metrics_url: str, timeout: float = TIMEOUT) -> Health:
    """The farm's /healthz beside `metrics_url` (503 with problems is an answer, not an
    error); Unreachable as for `read_metrics`. Blocking, and called by the `Sampler` only."""
    url = healthz_url(metrics_url)
    status, body = _fetch(url, timeout)
    try:
        detail = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise Unreachable(f"{shown(url)} answered {status} with no JSON: is it a farm?") from None
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
    """What the pages show of the farm: the latest rates and health, or why there are none,
    and how old each reading is (seconds; None before the first)."""

    url: str | None  # without credentials
    error: str | None = None
    latest: Reading | None = None
    queues: dict[str, QueueRates] = field(default_factory=dict)
    window: float | None = None  # seconds between the two readings the rates are from
    points: list[Point] = field(default_factory=list)
    health: Health | None = None
    health_error: str | None = None
    metrics_age: float | None = None
    health_age: float | None = None


class Sampler:
    """Reads the farm's /metrics and /healthz every `every` seconds while the console runs;
    owns the history and the last health.

    The only reader of the farm: no request ever waits on it, each page shows the last
    reading and its age. Each read runs in a thread of its own with a hard deadline
    (`timeout`, connect to last byte) and a body cap, so a farm that answers slowly, or
    never, delays nothing but the next reading. Every field is written by its own task
    (`run`) and read by request handlers, all on the event loop: `view` must be called on
    the loop (never from the thread pool), so a reader never sees a half-made reading.
    """

    def __init__(self, url: str | None, every: float, timeout: float = TIMEOUT) -> None:
        self.url = url or None
        self.every = every
        self.timeout = timeout
        self.readings: deque[Reading] = deque(maxlen=2)  # the last two, whole
        self.points: deque[Point] = deque(maxlen=int(HISTORY / every) + 1)
        self.rates: dict[str, QueueRates] = {}  # between the two readings
        self.error: str | None = None if url else "no --metrics-url given"
        self.health: Health | None = None
        self.health_error: str | None = None if url else "no --metrics-url given"
        self.metrics_at: float | None = None  # monotonic time of the last attempt to read
        self.health_at: float | None = None

    async def run(self) -> None:
        """Sample until cancelled. A failed read is remembered as the error to show; nothing
        else can end the loop (an unexpected exception is logged and the loop goes on)."""
        if self.url is None:
            return
        while True:
            await self.sample()
            await asyncio.sleep(self.every)

    async def sample(self) -> None:
        """One reading of /metrics and one of /healthz, side by side; returns within
        `timeout` (and a little) whatever the farm does."""
        await asyncio.gather(self._sample_metrics(), self._sample_health())

    async def _in_thread(self, read: Any) -> Any:
        # The thread ends by itself at the deadline (its socket is cut); waiting a little
        # longer here is a second guard that keeps the loop's promise if it somehow did not.
        assert self.url is not None
        return await asyncio.wait_for(
            asyncio.to_thread(read, self.url, self.timeout), self.timeout + 2.0
        )

    async def _sample_metrics(self) -> None:
        try:
            reading: Reading = await self._in_thread(read_metrics)
        except (Unreachable, TimeoutError) as exc:
            self.error = str(exc) or f"no answer within {self.timeout:g}s"
            return
        except Exception:
            log.exception("reading the farm's metrics failed", extra={"event": "console_sample"})
            self.error = "reading the farm's metrics failed (see the console's log)"
            return
        finally:
            self.metrics_at = time.monotonic()
        self.add(reading)

    def add(self, reading: Reading) -> None:
        """Keep `reading` (one taken no later than the last is dropped): the rates between it
        and the last, and the chart's point of them."""
        if self.readings and reading.scrape.at - self.readings[-1].scrape.at <= 0:
            return
        self.error = None
        if self.readings:
            self.rates = rates(self.readings[-1].scrape, reading.scrape)
            each = self.rates.values()
            self.points.append(
                Point(
                    reading.wall,
                    sum(r.acked for r in each),
                    sum(r.retried for r in each),
                    sum(r.terminal for r in each),
                )
            )
        self.readings.append(reading)

    async def _sample_health(self) -> None:
        try:
            self.health = await self._in_thread(read_health)
            self.health_error = None
        except (Unreachable, TimeoutError) as exc:
            self.health, self.health_error = None, str(exc) or "no answer in time"
        except Exception:
            log.exception("reading the farm's /healthz failed", extra={"event": "console_sample"})
            self.health, self.health_error = None, "reading /healthz failed (see the log)"
        finally:
            self.health_at = time.monotonic()

    def view(self) -> FarmView:
        """What the pages show now. On the event loop only (see the class)."""
        now = time.monotonic()
        view = FarmView(shown(self.url) if self.url else None, self.error)
        view.health, view.health_error = self.health, self.health_error
        if self.url and self.health is None and self.health_error is None:
            view.health_error = "not read yet"
        if self.metrics_at is not None:
            view.metrics_age = now - self.metrics_at
        if self.health_at is not None:
            view.health_age = now - self.health_at
        if self.readings:
            view.latest = self.readings[-1]
        if len(self.readings) == 2:
            view.queues = self.rates
            view.window = self.readings[1].scrape.at - self.readings[0].scrape.at
        view.points = list(self.points)
        return view
