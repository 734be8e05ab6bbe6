"""What the chaos scenarios record and check: their results, and the probes of a running farm
(health, metrics, events, drains) each scenario's findings are made of."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import psycopg

from loadtests.common import expected, tables
from loadtests.common.farmproc import get
from loadtests.common.waits import wait_until

from .farms import FarmRun
from .load import PRODUCER


@dataclass
class Context:
    admin: str  # a server the suite may create databases on (never restarted)
    work: Path
    scale: float = 1.0

    def seconds(self, full: float) -> float:
        return max(full * self.scale, 3.0)


@dataclass
class Finding:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class Result:
    scenario: str
    published: int = 0
    handled: int = 0
    duplicates: int = 0
    explained: bool = True
    lost: int = 0
    recovery: float | None = None
    findings: list[Finding] = field(default_factory=list)
    note: str = ""

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.findings)

    def failures(self) -> list[Finding]:
        return [f for f in self.findings if not f.ok]


RECOVERY = 30.0  # seconds a farm may take to be healthy again: a backed-off slot and a boot


def survived(result: Result, run: FarmRun, *, restarts_allowed: bool = False) -> None:
    """The farm is up and becomes healthy within `RECOVERY`, and (unless the fault kills
    workers on purpose) replaced none of its workers. Waited for, not sampled: a worker killed
    a moment ago is replaced after its slot's backoff and a boot, which a busy machine slows."""

    def healthy() -> bool:
        return run.proc.poll() is None and (run.health() or (0, {}))[0] == 200

    alive = wait_until(healthy, RECOVERY)
    detail = "" if alive else f"/healthz: {run.health()}; exit: {run.proc.poll()}\n{run.tail(3)}"
    result.findings.append(Finding("farm-keeps-running", alive, detail))
    if not restarts_allowed:
        restarts = run.scrape().total("outbox_farm_worker_restarts_total")
        result.findings.append(
            Finding("no-worker-restarts", restarts == 0, f"{restarts:g} restarts")
        )


def unhealthy_with(run: FarmRun, text: str) -> bool:
    health = run.health()
    return health is not None and health[0] == 503 and text in str(health[1])


def measure_drain(dsn: str, run: FarmRun, rows: int) -> float:
    """Messages per second the running farm drains from a pre-loaded backlog of `rows`."""
    with psycopg.connect(dsn) as conn:
        with conn.transaction():
            expected.publish(conn, PRODUCER, "ok", count=rows)
        began = time.monotonic()
        while True:
            left = conn.execute(tables.query("SELECT count(*) FROM {outbox}")).fetchone()
            conn.commit()
            if left is None or left[0] == 0:
                return rows / (time.monotonic() - began)
            time.sleep(0.05)


BACKLOG = tables.query(
    "SELECT count(*), coalesce(extract(epoch FROM now() - min(next_attempt_at)), 0) "
    "FROM {outbox} WHERE acquired_token IS NULL"
)


def sample_backlog(dsn: str, peak: list[int], lag: list[float], stop: threading.Event) -> None:
    with psycopg.connect(dsn, autocommit=True, application_name="chaos-check") as conn:
        while not stop.wait(0.5):
            row: Any = conn.execute(BACKLOG).fetchone()
            peak[0] = max(peak[0], int(row[0]))
            lag[0] = float(row[1])


FAST = 0.5  # seconds: "within 100 ms" on a busy 2-core box


def healthy(run: FarmRun) -> bool:
    return run.proc.poll() is None and (run.health() or (0, {}))[0] == 200


def events_named(run: FarmRun, *names: str) -> list[dict[str, Any]]:
    return [e for e in run.events() if e.get("event") in names]


def oldest(run: FarmRun) -> int | None:
    """The worker that has run longest (so that workers from before a clock step die too)."""
    born = {}
    for pid in run.workers():
        with contextlib.suppress(psutil.Error):
            born[pid] = psutil.Process(pid).create_time()
    return min(born, key=lambda pid: born[pid]) if born else None


def kill_pid(run: FarmRun, pid: int | None) -> None:
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    run.killed.add(pid)


Sample = tuple[float, int | None, str, float]  # (when, status or None, body, seconds)


class HealthSampler:
    """/healthz asked every 0.1 s from a thread: status, body and how long the answer took."""

    def __init__(self, run: FarmRun) -> None:
        self.run = run
        self.samples: list[Sample] = []
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._go, daemon=True, name="chaos-healthz")

    def start(self) -> HealthSampler:
        self._thread.start()
        return self

    def stop(self) -> list[Sample]:
        self._halt.set()
        self._thread.join(15)
        return self.samples

    def _go(self) -> None:
        while not self._halt.wait(0.1):
            began = time.monotonic()
            got = get(self.run.url + "/healthz")
            status, body = (got[0], got[1].decode(errors="replace")) if got else (None, "")
            self.samples.append((began, status, body, time.monotonic() - began))


def watch_health(run: FarmRun, seconds: float) -> list[Sample]:
    sampler = HealthSampler(run).start()
    end = time.monotonic() + seconds
    while time.monotonic() < end and run.proc.poll() is None:
        time.sleep(0.2)
    return sampler.stop()


def healthy_throughout(name: str, samples: list[Sample]) -> Finding:
    bad = [s for s in samples if s[1] != 200]
    if not samples:
        return Finding(name, False, "no answers")
    if bad:
        return Finding(name, False, f"{len(bad)} of {len(samples)} not 200: {bad[0][2][:80]}")
    return Finding(name, True)


def healthz_answers_fast(name: str, samples: list[Sample]) -> Finding:
    worst = max((s[3] for s in samples), default=0.0)
    unanswered = sum(1 for s in samples if s[1] is None)
    ok = bool(samples) and worst <= FAST and not unanswered
    detail = f"worst {worst * 1000:.0f} ms, {unanswered} of {len(samples)} unanswered"
    return Finding(name, ok, detail)


def supervised(result: Result, run: FarmRun, *, crashes: int | None = None) -> None:
    """The supervisor's own invariants (DESIGN.md 11, 14): still running, never halted, no
    death booked as a boot failure or a silent heartbeat; `crashes`: how many it must book."""
    alive = run.proc.poll() is None
    halts = events_named(run, "halt")
    result.findings.append(
        Finding(
            "farm-keeps-running",
            alive and not halts,
            "" if alive and not halts else f"exit {run.proc.poll()}; {run.tail(3)}",
        )
    )
    if not alive:
        return
    restarts = run.scrape().by("outbox_farm_worker_restarts_total", "reason")
    count = {reason: restarts.get((reason,), 0.0) for reason in ("crash", "heartbeat", "boot")}
    result.findings.append(
        Finding("no-boot-failures", count["boot"] == 0, f"worker_restarts_total {count}")
    )
    result.findings.append(
        Finding("no-heartbeat-kills", count["heartbeat"] == 0, f"worker_restarts_total {count}")
    )
    if crashes is not None:
        result.findings.append(
            Finding(
                "kills-booked-as-crashes", count["crash"] == crashes, f"{count}; {crashes} kills"
            )
        )
