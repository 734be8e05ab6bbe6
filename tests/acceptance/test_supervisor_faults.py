"""The supervisor outlives its environment (DESIGN.md invariants 11 and 14, issue 24 points 1,
2 and 4): wall-clock steps, a database restart or blackhole while workers die, a worker whose
event loop is stuck.

Real `outbox-farm start` subprocesses (helpers from `test_farm`), a real Postgres, and an app
(`supapp.py`, written per test):

- `q`: records every row it handles in `ledger(id, pid)` on a connection it makes again after
  a database restart, retried every 0.5 s without limit (10 s leases): every published row must
  get there.
- `block`: an async handler that blocks the event loop past the heartbeat timeout.

The faults come from `loadtests/chaos/outage.py`: a libfaketime wall clock read from a file
rewritten while the farm runs (CLOCK_MONOTONIC untouched, as in an NTP step), and an embedded
Postgres of the test's own, stopped and started, or reached through a proxy that blackholes it.
The shared server is never stopped.

Each test watches for every failure it can see and reports them together at the end, so that a
failing run names everything that went wrong, not only the first thing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest

from loadtests.chaos.farms import is_worker
from loadtests.chaos.outage import (
    FakeClock,
    StoppableServer,
    TcpProxy,
    faketime_missing,
    via,
    wall_clock_offset,
)
from loadtests.common.harness import scratch_database
from outbox_farm.names import TableNames
from tests.acceptance.test_farm import RunningFarm, farm_process
from tests.steps import poll, publish, wait_for
from tests.tools import missing_tool

pytestmark = pytest.mark.slow

SUPAPP = '''\
"""Supervisor-fault app: `q` records each row in `ledger`; `block` blocks the event loop."""
import os
import time

import psycopg

from outbox_farm import ConstantBackoff, Farm, Message

farm = Farm(table="outbox", dlq_table="outbox_dlq")
_conn = {}  # pid -> connection, made again when the database restarted


# A short lease: rows a worker held when it died during a blackhole (no hand-back possible)
# come back within seconds of the network healing; running handlers' leases are extended.
@farm.handler(
    "q", concurrency=16, max_deliveries=None, retry=ConstantBackoff(0.5), lease_ttl=10.0
)
async def record(msg: Message) -> None:
    conn = _conn.get(os.getpid())
    if conn is None or conn.closed or conn.broken:
        conn = _conn[os.getpid()] = await psycopg.AsyncConnection.connect(
            os.environ["SUPAPP_DSN"], autocommit=True, connect_timeout=3
        )
    await conn.execute("INSERT INTO ledger (id, pid) VALUES (%s, %s)", (msg.id, os.getpid()))


@farm.handler("block", concurrency=1, max_deliveries=1)
async def blocks_the_event_loop(msg: Message) -> None:
    time.sleep(float(os.environ.get("SUPAPP_BLOCK", "30")))  # no heartbeat meanwhile
'''
APP = "supapp:farm"
NAMES = TableNames.build("outbox", "outbox_dlq")
FAST = 0.5  # seconds: what "answers within 100 ms" gets on a busy 2-core box


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    (tmp_path / "supapp.py").write_text(SUPAPP)
    return tmp_path


def make_ledger(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE ledger (id bigint NOT NULL, pid int NOT NULL)")


@pytest.fixture
def private_db() -> Iterator[tuple[StoppableServer, str]]:
    """A Postgres of this test's own (may be stopped), and a migrated database on it."""
    server = StoppableServer()
    try:
        with scratch_database(server.dsn, NAMES, prefix="outbox_farm_sup_") as dsn:
            make_ledger(dsn)
            yield server, dsn
    finally:
        server.close()


@pytest.fixture
def clock(tmp_path: Path) -> FakeClock:
    missing = faketime_missing()
    if missing:
        missing_tool(missing)
    clock = FakeClock(tmp_path / "clock")
    # The step is real in a running process: a process of this environment sees it.
    assert abs(wall_clock_offset(clock.env())) < 30
    return clock


# -- load and observation ------------------------------------------------------------------


class Publisher:
    """Publishes `per_tick` rows into `q` every 0.1 s from a thread, reconnecting through
    outages; `ids` are the rows whose commit was confirmed."""

    def __init__(self, dsn: str, per_tick: int = 5) -> None:
        self.dsn, self.per_tick = dsn, per_tick
        self.ids: list[int] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="publisher")

    def _run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        while not self._stop.wait(0.1):
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = psycopg.connect(self.dsn, connect_timeout=2)
                with conn.transaction():
                    ids = publish(conn, self.per_tick, queue="q")
                self.ids += ids
            except psycopg.Error:
                self.failures += 1
                if conn is not None:
                    conn.close()
                conn = None
        if conn is not None:
            conn.close()

    def __enter__(self) -> Publisher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join(15)
        return self.ids


class HealthWatch:
    """Asks /healthz every `every` s from a thread: each answer's status, reason and latency
    (None: no answer within 10 s); and whether the farm exited meanwhile."""

    def __init__(self, farm: RunningFarm, every: float = 0.1) -> None:
        self.farm, self.every = farm, every
        self.samples: list[tuple[float, int | None, str, float]] = []  # (at, status, body, s)
        self.exit_code: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="healthz")

    def _ask(self) -> tuple[int | None, str]:
        url = f"http://127.0.0.1:{self.farm.port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                return reply.status, reply.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, exc.read().decode(errors="replace")
        except OSError as exc:
            return None, repr(exc)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            began = time.monotonic()
            status, body = self._ask()
            self.samples.append((began, status, body, time.monotonic() - began))
            if self.farm.proc.poll() is not None and self.exit_code is None:
                self.exit_code = self.farm.proc.returncode

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)

    def since(self, t: float) -> list[tuple[float, int | None, str, float]]:
        return [s for s in self.samples if s[0] >= t]

    @staticmethod
    def worst(samples: list[tuple[float, int | None, str, float]]) -> float:
        return max((s[3] for s in samples), default=0.0)


def events(farm: RunningFarm) -> list[dict[str, Any]]:
    found = []
    for line in farm.log().splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict):
                found.append(entry)
    return found


def workers(farm: RunningFarm) -> set[int]:
    """The arbiter's live worker processes: not the one serving /metrics and /healthz, nor a
    short-lived hand-back process (workers name themselves)."""
    try:
        children = psutil.Process(farm.pid).children()
    except psutil.NoSuchProcess:
        return set()
    return {child.pid for child in children if is_worker(child)}


def named(farm: RunningFarm, *names: str) -> list[dict[str, Any]]:
    return [e for e in events(farm) if e.get("event") in names]


def oldest_worker(farm: RunningFarm) -> int:
    born = {}
    for pid in workers(farm):
        with contextlib.suppress(psutil.NoSuchProcess):
            born[pid] = psutil.Process(pid).create_time()
    return min(born, key=lambda pid: born[pid])


def died_at(log: str, pid: int) -> int:
    """Where in `log` the line saying worker `pid` died begins (its reaping: after the kill)."""
    at = 0
    for line in log.splitlines(keepends=True):
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if (
                isinstance(entry, dict)
                and entry.get("event") == "worker_died"
                and f"worker {pid} " in str(entry.get("message"))
            ):
                return at
        at += len(line)
    raise AssertionError(f"no worker_died line for {pid}")


def delivered(dsn: str, ids: list[int]) -> tuple[int, int]:
    """(published rows not in the ledger, rows left in the outbox); (-1, -1) while the
    database does not answer."""
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=3) as conn:
            handled = {int(r[0]) for r in conn.execute("SELECT DISTINCT id FROM ledger")}
            left = conn.execute("SELECT count(*) FROM outbox").fetchone()
    except psycopg.Error:
        return -1, -1
    return len(set(ids) - handled), int(left[0]) if left else 0


def wait_delivered(farm: RunningFarm, dsn: str, ids: list[int], timeout: float) -> str | None:
    """None once every row of `ids` is in the ledger and the outbox is empty; else what is
    missing at the deadline."""
    if poll(lambda: delivered(dsn, ids) == (0, 0), timeout, 0.5, farm):
        return None
    missing, left = delivered(dsn, ids)
    return f"{missing} of {len(ids)} published rows never handled, {left} left in the outbox"


def kill(pids: set[int] | list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_replaced(farm: RunningFarm, gone: set[int], procs: int, timeout: float) -> bool:
    """Whether `procs` live workers (or more), none of `gone`, run within `timeout` s."""

    def replaced() -> bool:
        kids = workers(farm)
        return len(kids) >= procs and not kids & gone  # >=: one told to retire may still drain

    return poll(replaced, timeout, 0.05, farm)


def wait_reaped(farm: RunningFarm, pids: set[int], timeout: float) -> bool:
    """Whether the arbiter reaped one of `pids` (dead, and no longer a zombie) within
    `timeout` s: it is then busy with what follows a death (hand-back, replacement)."""

    def reaped() -> bool:
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    continue
            except psutil.NoSuchProcess:
                return True
        return False

    return poll(reaped, timeout, 0.005, farm)


def signal_latency(farm: RunningFarm, sig: signal.Signals, event: str, timeout: float) -> float:
    """Send `sig` to the arbiter; the seconds until its `event` line is in the log (inf if
    never within `timeout`)."""
    before = len(named(farm, event))
    began = time.monotonic()
    farm.proc.send_signal(sig)
    if poll(lambda: len(named(farm, event)) > before, timeout, 0.005):
        return time.monotonic() - began
    return float("inf")


def exit_note(farm: RunningFarm) -> str:
    code = farm.proc.poll()
    return "" if code is None else f"the farm EXITED with status {code}"


def report(problems: list[str], farm: RunningFarm) -> None:
    assert not problems, "\n".join(["", *problems, "--- log tail ---", farm.log_tail(25)])


# -- 1. clock steps ----------------------------------------------------------------------------

HEARTBEAT = 3.0  # --heartbeat-timeout of the clock tests: a wrong kill shows within seconds


def clocked_farm(
    app_dir: Path, dsn: str, clock: FakeClock
) -> contextlib.AbstractContextManager[RunningFarm]:
    """The clock tests' farm: JSON log, a short heartbeat timeout, every process on `clock`."""
    return farm_process(
        app_dir,
        dsn,
        "--log-format",
        "json",
        "--heartbeat-timeout",
        str(HEARTBEAT),
        app=APP,
        SUPAPP_DSN=dsn,
        **clock.env(),
    )


@pytest.mark.one_server
def test_a_forward_wall_clock_step_kills_no_worker(
    app_dir: Path, dsn: str, clock: FakeClock
) -> None:
    """+1 h on the wall clock (NTP step, VM resume): the same workers run on, /healthz stays
    200, rows keep being delivered, nobody is killed for a silent heartbeat."""
    make_ledger(dsn)
    problems: list[str] = []
    with clocked_farm(app_dir, dsn, clock) as farm:
        wait_for(lambda: farm.healthy(2), "2 healthy workers", 60, farm)
        before = workers(farm)
        with Publisher(dsn) as load, HealthWatch(farm) as health:
            wait_for(lambda: len(load.ids) >= 20, "rows published", 30, farm)
            assert wait_delivered(farm, dsn, list(load.ids), 30) is None
            clock.set("+1h")
            stepped = time.monotonic()
            offset = wall_clock_offset(clock.env())
            assert abs(offset - 3600) < 60, f"the step did not happen: offset {offset:.0f}s"
            # Watch for 3 heartbeat timeouts: a worker judged silent would be killed in 1.
            mark = len(load.ids)
            poll(lambda: named(farm, "worker_stuck"), 3 * HEARTBEAT + 2, 0.2, farm)
            after = list(load.ids[mark:])
            missing = wait_delivered(farm, dsn, after, 30)
            if missing:
                problems.append(f"rows published after the step: {missing}")
            bad = [s for s in health.since(stepped) if s[1] != 200]
            if bad:
                problems.append(
                    f"/healthz not 200 after the step in {len(bad)} of "
                    f"{len(health.since(stepped))} answers, e.g. {bad[0][1]} {bad[0][2]}"
                )
        stuck = named(farm, "worker_stuck")
        if stuck:
            problems.append(f"{len(stuck)} worker_stuck: {stuck[0].get('message')}")
        if workers(farm) != before:
            problems.append(f"workers replaced: {sorted(before)} -> {sorted(workers(farm))}")
        if note := exit_note(farm):
            problems.append(note)
        report(problems, farm)
        missing = wait_delivered(farm, dsn, load.ids, 30)
        assert missing is None, missing
        code, _ = farm.stop()
    assert code == 0, farm.log_tail()


@pytest.mark.one_server
@pytest.mark.parametrize("offset", ["-1h", "-10m"])
def test_after_a_backward_wall_clock_step_crashes_stay_crashes(
    app_dir: Path, dsn: str, clock: FakeClock, offset: str
) -> None:
    """The wall clock goes back, then workers are SIGKILLed 5 times (the oldest first, so the
    workers that booted before the step die too): each is replaced as a crash, none counts as
    a boot failure, the farm does not halt, /healthz is 200 throughout but for the moments a
    worker is missing, and every row is delivered."""
    make_ledger(dsn)
    problems: list[str] = []
    with clocked_farm(app_dir, dsn, clock) as farm:
        wait_for(lambda: farm.healthy(2), "2 healthy workers", 60, farm)
        with Publisher(dsn) as load, HealthWatch(farm) as health:
            wait_for(lambda: len(load.ids) >= 20, "rows published", 30, farm)
            clock.set(offset)
            stepped = time.monotonic()
            seen = wall_clock_offset(clock.env())
            want = -3600 if offset == "-1h" else -600
            assert abs(seen - want) < 60, f"the step did not happen: offset {seen:.0f}s"
            # Three heartbeats after the step, before anything is killed: /healthz says 200.
            wait_for(lambda: time.monotonic() - stepped > 3.5, "3 heartbeats", 10, farm)
            bad = [s for s in health.since(stepped) if s[1] != 200]
            if bad:
                problems.append(
                    f"/healthz not 200 after the {offset} step (before any kill) in {len(bad)} "
                    f"of {len(health.since(stepped))} answers, e.g. {bad[0][1]} {bad[0][2]}"
                )
            for round_ in range(1, 6):
                victim = oldest_worker(farm)
                kill([victim])
                if not wait_replaced(farm, {victim}, 2, 30):
                    problems.append(
                        f"kill #{round_}: worker {victim} not replaced within 30s "
                        f"({exit_note(farm) or f'workers {sorted(workers(farm))}'})"
                    )
                    break
            if not wait_healthy(farm, 2, 30):
                problems.append(f"/healthz not 200 within 30s after the kills: {farm.health()}")
        died = named(farm, "worker_died")
        failed = named(farm, "boot_failed")
        if len(died) < 5 or any(e.get("reason") != "crash" for e in died):
            reasons = [e.get("reason") for e in died]
            problems.append(f"{len(died)} worker_died events (reasons {reasons}), 5 crashes wanted")
        if failed:
            problems.append(f"{len(failed)} boot_failed: {failed[0].get('message')}")
        if halt := named(farm, "halt"):
            problems.append(f"halt: {halt[0].get('message')}")
        if note := exit_note(farm):
            problems.append(note)
        if farm.proc.poll() is None:
            missing = wait_delivered(farm, dsn, load.ids, 60)
            if missing:
                problems.append(missing)
        report(problems, farm)
        code, _ = farm.stop()
    assert code == 0, farm.log_tail()


@contextlib.contextmanager
def proxied_farm(
    app_dir: Path, server: StoppableServer, dsn: str, *, graceful: float
) -> Iterator[tuple[TcpProxy, RunningFarm]]:
    """The supervisor app's farm, reaching `server` through a proxy the test can blackhole."""
    with (
        TcpProxy(server.socket_path) as proxy,
        farm_process(
            app_dir,
            via(dsn, proxy.port),
            "--log-format",
            "json",
            graceful=graceful,
            app=APP,
            SUPAPP_DSN=dsn,
        ) as farm,
    ):
        yield proxy, farm


def wait_healthy(farm: RunningFarm, procs: int, timeout: float) -> bool:
    return poll(lambda: farm.healthy(procs), timeout, 0.2, farm)


# -- 2. database outages during crashes ----------------------------------------------------


@pytest.mark.one_server
@pytest.mark.timeout(240)
def test_a_database_restart_while_workers_die_is_waited_out(
    app_dir: Path, private_db: tuple[StoppableServer, str]
) -> None:
    """Our own Postgres stops (fast shutdown) under load; every worker is SIGKILLed 3 times
    while it is down (12 s, longer than 5 boot failures take); then it starts again. The farm
    never exits, /healthz answers at once throughout (503 naming the database while it is
    down), and everything published is delivered after."""
    server, dsn = private_db
    problems: list[str] = []
    with farm_process(app_dir, dsn, "--log-format", "json", app=APP, SUPAPP_DSN=dsn) as farm:
        wait_for(lambda: farm.healthy(2), "2 healthy workers", 60, farm)
        with Publisher(dsn) as load, HealthWatch(farm) as health:
            wait_for(lambda: len(load.ids) >= 50, "rows published", 30, farm)
            server.stop("fast")
            down = time.monotonic()
            for round_ in range(1, 4):
                victims = workers(farm)
                kill(victims)
                if not wait_replaced(farm, victims, 2, 10):
                    problems.append(
                        f"kill #{round_} during the outage: workers not replaced within 10s "
                        f"({exit_note(farm) or f'workers {sorted(workers(farm))}'})"
                    )
                    break
            while time.monotonic() - down < 12 and farm.proc.poll() is None:
                time.sleep(0.2)  # the outage lasts past the 5-boot-failure window (6.1 s seen)
            outage = health.since(down)
            server.start()
            up = time.monotonic()
            if not wait_healthy(farm, 2, 60):
                problems.append(f"not healthy within 60s of the restart: {farm.health()}")
            load.stop()
            missing = wait_delivered(farm, dsn, load.ids, 90) if farm.proc.poll() is None else ""
            if missing or farm.proc.poll() is not None:
                problems.append(f"after the restart: {missing or 'farm gone'}")
        statuses = sorted({str(s[1]) for s in outage})
        reasons = sorted({s[2][:120] for s in outage if s[1] == 503})
        worst = HealthWatch.worst(outage)
        print(
            f"outage {up - down:.1f}s: /healthz statuses {statuses}, worst {worst * 1000:.0f} ms,"
            f" 503 bodies {reasons[:2]}; {len(load.ids)} rows published "
            f"({load.failures} publish failures)"
        )
        unanswered = [s for s in outage if s[1] is None]
        if worst > FAST or unanswered:
            problems.append(
                f"/healthz during the outage: worst {worst:.2f}s, {len(unanswered)} of "
                f"{len(outage)} unanswered"
            )
        if not any("database unreachable" in s[2] for s in outage if s[1] == 503):
            problems.append(f"/healthz never said 'database unreachable' while down: {reasons[:3]}")
        if halt := named(farm, "halt"):
            problems.append(f"halt: {halt[0].get('message')}")
        if health.exit_code is not None or exit_note(farm):
            problems.append(f"the farm exited (status {farm.proc.poll()})")
        report(problems, farm)
        code, _ = farm.stop()
    assert code == 0, farm.log_tail()


@pytest.mark.one_server
@pytest.mark.timeout(240)
def test_a_blackholed_database_never_blocks_the_arbiter(
    app_dir: Path, private_db: tuple[StoppableServer, str]
) -> None:
    """The farm reaches our Postgres through a proxy that starts swallowing every packet;
    workers are SIGKILLed meanwhile. /healthz and TTIN/TTOU are answered within milliseconds
    (the arbiter never waits on the database), the farm stays up, and after the network heals
    everything is delivered."""
    server, dsn = private_db
    problems: list[str] = []
    with proxied_farm(app_dir, server, dsn, graceful=5) as (proxy, farm):
        wait_for(lambda: farm.healthy(2), "2 healthy workers", 60, farm)
        with Publisher(dsn) as load, HealthWatch(farm, every=0.05) as health:
            wait_for(lambda: len(load.ids) >= 50, "rows published", 30, farm)
            proxy.blackhole()
            began = time.monotonic()
            latencies: dict[str, float] = {}
            victims = workers(farm)
            kill(victims)
            wait_reaped(farm, victims, 5)  # the arbiter is handling the deaths now
            latencies["TTIN"] = signal_latency(farm, signal.SIGTTIN, "scaled", 30)
            if not wait_replaced(farm, victims, 3, 15):
                problems.append(
                    f"3 workers (after TTIN) not running within 15s of the kill: "
                    f"{exit_note(farm) or sorted(workers(farm))}"
                )
            victims = workers(farm)
            kill(victims)
            wait_reaped(farm, victims, 5)
            latencies["TTOU"] = signal_latency(farm, signal.SIGTTOU, "scaled", 30)
            if not wait_replaced(farm, victims, 2, 15):
                problems.append(
                    f"2 workers (after TTOU) not running within 15s of the kill: "
                    f"{exit_note(farm) or sorted(workers(farm))}"
                )
            while time.monotonic() - began < 12 and farm.proc.poll() is None:
                time.sleep(0.2)  # the blackhole lasts 12 s on purpose, /healthz asked meanwhile
            blackholed = health.since(began)
            proxy.restore()
            if not wait_healthy(farm, 2, 60):
                problems.append(f"not healthy within 60s after the network healed: {farm.health()}")
            load.stop()
            missing = wait_delivered(farm, dsn, load.ids, 90) if farm.proc.poll() is None else ""
            if missing or farm.proc.poll() is not None:
                problems.append(f"after the blackhole: {missing or 'farm gone'}")
        worst = HealthWatch.worst(blackholed)
        unanswered = [s for s in blackholed if s[1] is None]
        print(
            f"blackhole: /healthz worst {worst * 1000:.0f} ms over {len(blackholed)} asks "
            f"({len(unanswered)} unanswered); "
            + ", ".join(f"{k} acted on in {v * 1000:.0f} ms" for k, v in latencies.items())
        )
        if worst > FAST or unanswered:
            problems.append(
                f"/healthz during the blackhole: worst {worst:.2f}s, {len(unanswered)} of "
                f"{len(blackholed)} unanswered"
            )
        for what, took in latencies.items():
            if took > FAST:
                problems.append(f"{what} acted on {took:.2f}s after the signal")
        if halt := named(farm, "halt"):
            problems.append(f"halt: {halt[0].get('message')}")
        if note := exit_note(farm):
            problems.append(note)
        report(problems, farm)
        code, _ = farm.stop()
    assert code == 0, farm.log_tail()


@pytest.mark.one_server
def test_sigterm_during_a_blackhole_exits_within_the_graceful_timeout(
    app_dir: Path, private_db: tuple[StoppableServer, str]
) -> None:
    """The database stops answering (not refusing: blackholed) under load, then SIGTERM: the
    farm is gone within its graceful timeout (5 s), with status 0. Whatever it could not hand
    back comes back when its leases expire."""
    server, dsn = private_db
    graceful = 5.0
    with proxied_farm(app_dir, server, dsn, graceful=graceful) as (proxy, farm):
        wait_for(lambda: farm.healthy(2), "2 healthy workers", 60, farm)
        with Publisher(dsn) as load:
            wait_for(lambda: len(load.ids) >= 50, "rows published", 30, farm)
            proxy.blackhole()
            wait_for(lambda: len(load.ids) >= 100, "rows published while blackholed", 30, farm)
            code, took = farm.stop(timeout=graceful + 60)
        print(f"SIGTERM during the blackhole: exit {code} after {took:.1f}s")
        ok = took <= graceful + 2.0 and code == 0
        assert ok, f"exit {code} after {took:.1f}s (graceful {graceful:g}s)\n{farm.log_tail(25)}"


# -- 3. a stuck worker leaves evidence -------------------------------------------------------


def test_a_worker_killed_for_a_blocked_loop_leaves_its_stack_in_the_log(
    app_dir: Path, dsn: str
) -> None:
    """An async handler calls time.sleep past the heartbeat timeout: the worker is killed and
    replaced, and before the kill its Python stack (naming the handler) is in the farm's
    output, so the operator sees what blocked the loop."""
    make_ledger(dsn)
    with farm_process(
        app_dir,
        dsn,
        "--log-format",
        "json",
        "--heartbeat-timeout",
        "2",
        procs=1,
        app=APP,
        SUPAPP_DSN=dsn,
        SUPAPP_BLOCK="60",
    ) as farm:
        wait_for(lambda: farm.healthy(1), "a healthy worker", 60, farm)
        (worker,) = workers(farm)
        publish(dsn, 1, queue="block")
        wait_for(
            lambda: [e for e in named(farm, "worker_died") if f"worker {worker} " in e["message"]],
            f"worker {worker} killed and reaped",
            30,
            farm,
        )
        log = farm.log()
        died = died_at(log, worker)
        stack = [m.start() for m in re.finditer(r"Current thread 0x|Thread 0x", log)]
        frame = r'File "[^"]*supapp\.py", line \d+ in blocks_the_event_loop'
        handler = [m.start() for m in re.finditer(frame, log)]
        dumped = bool(stack and handler) and max(stack[0], handler[0]) < died
        assert dumped, (
            "no Python stack of the stuck worker (a 'Thread 0x...' dump with the frame of "
            "blocks_the_event_loop) in the farm's output before it was killed:\n"
            + "\n".join(log[:died].splitlines()[-15:])
        )
        wait_for(lambda: farm.healthy(1), "a healthy replacement", 30, farm)
        code, _ = farm.stop()
    assert code == 0, farm.log_tail()
