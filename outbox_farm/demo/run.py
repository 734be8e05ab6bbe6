"""`outbox-farm demo`: the whole path in seconds, on the embedded Postgres (or yours).

Migrates tables of its own (`outbox_demo`, `outbox_demo_dlq`, so a real outbox is never
touched), publishes the messages, starts a real `outbox-farm start --procs N` on
`outbox_farm.demo.app`, follows it through its /metrics, and stops it. Everything it reports
comes from the farm's own metrics, as a dashboard would read them.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..admin.rates import Scrape, quantile, scrape
from ..db.connect import connect
from ..errors import OutboxFarmError
from ..ops.migrate import migrate
from .app import QUEUE, farm

BATCH = 1000
DRAIN_LIMIT = 300.0  # seconds: a demo that has not drained by then says so and stops


@dataclass(frozen=True)
class Summary:
    messages: int
    seconds: float  # from the farm's first delivery to the last
    acked: float
    retried: float
    dead_lettered: float
    lag_p50: float | None
    lag_p99: float | None
    metrics_url: str


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def publish(dsn: str, messages: int, progress: Callable[[int], None]) -> None:
    """Migrate the demo tables and publish `messages` bodies in batches of BATCH."""
    with connect(dsn) as conn:
        migrate(conn, farm.names)
        for start in range(0, messages, BATCH):
            bodies = [{"n": n} for n in range(start, min(start + BATCH, messages))]
            farm.publish_batch(conn, bodies, queue=QUEUE)
            conn.commit()
            progress(len(bodies))


def _total(reading: Scrape, counter: str) -> float:
    return reading.totals.get((counter, QUEUE), 0.0)


def _handled(reading: Scrape) -> float:
    """Messages done with: acked, or dead-lettered."""
    return _total(reading, "acked") + _total(reading, "terminal")


def _report(
    reading: Scrape, last: Scrape | None, messages: int, say: Callable[[str], None]
) -> None:
    seconds = reading.at - last.at if last is not None else 0.0
    rate = (_handled(reading) - _handled(last)) / seconds if last is not None and seconds else 0.0
    say(
        f"  handled {_handled(reading):>9,.0f} / {messages:,}   {rate:>8,.0f} msg/s   "
        f"retried {_total(reading, 'retried'):,.0f}   DLQ {_total(reading, 'terminal'):,.0f}"
    )


def _failed(what: str, workdir: Path) -> OutboxFarmError:
    """The error for a demo farm that failed, with the end of its log (its directory goes)."""
    lines = (workdir / "farm.log").read_text(errors="replace").splitlines()[-20:]
    return OutboxFarmError(f"{what}; the end of its log:\n" + "\n".join(lines))


def _read(url: str) -> Scrape | None:
    try:
        return scrape(url, timeout=2.0)
    except OutboxFarmError:
        return None  # not serving yet


def run_farm(
    dsn: str, messages: int, procs: int, say: Callable[[str], None], workdir: Path
) -> Summary:
    """Start the farm, report its progress every second until every message was handled
    (acked or dead-lettered), stop it; what it did, read from its /metrics."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    command = [
        sys.executable, "-m", "outbox_farm.cli", "start", "outbox_farm.demo.app:farm",
        "--procs", str(procs), "--dsn", dsn,
        "--metrics-bind", f"127.0.0.1:{port}", "--metrics-dir", str(workdir / "metrics"),
        "--log-level", "ERROR",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_FARM_")}
    log = (workdir / "farm.log").open("wb")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        first: float | None = None
        last: Scrape | None = None  # the reading last reported
        deadline = time.monotonic() + DRAIN_LIMIT
        while True:
            time.sleep(0.2)
            if proc.poll() is not None:
                raise _failed(f"the demo farm exited with status {proc.returncode}", workdir)
            reading = _read(url)
            if reading is None:
                continue
            done = _handled(reading)
            if done and first is None:
                first = reading.at
            finished = done >= messages
            if last is None or reading.at - last.at >= 1.0 or finished:
                _report(reading, last, messages, say)
                last = reading
            if finished:
                break
            if time.monotonic() > deadline:
                raise _failed(
                    f"the demo farm handled {done:,.0f} of {messages:,} messages in "
                    f"{DRAIN_LIMIT:.0f}s",
                    workdir,
                )
        lag = last.buckets.get(QUEUE, {})
        return Summary(
            messages=messages,
            seconds=last.at - (first or last.at),
            acked=_total(last, "acked"),
            retried=_total(last, "retried"),
            dead_lettered=_total(last, "terminal"),
            lag_p50=quantile(0.5, lag),
            lag_p99=quantile(0.99, lag),
            metrics_url=url,
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
