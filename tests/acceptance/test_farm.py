"""`outbox-farm start` as a subprocess: the prefork arbiter, its children, /metrics and /healthz.

Every test runs the real console script in its own session (so the whole process group can be
killed afterwards), with its log in pytest's tmp_path and a small app, `farmapp.py`, written
there at run time. The app's one handler (queue "q") is configured by environment variables:
how long it sleeps, its concurrency / prefetch / lease_ttl, and whether it records each row it
handled in a `ledger(id, pid)` table of the test database, which is how lost and duplicated
deliveries are counted. Every wait is a deadline-bounded poll.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import psutil
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from loadtests.common.farmproc import get
from outbox_farm.prefork.child import WORKER_NAME
from tests.steps import publish, wait_for

pytestmark = pytest.mark.slow

CLI = Path(sys.executable).parent / "outbox-farm"
GRACEFUL = 10.0  # --graceful-timeout of every farm started here

FARMAPP = '''\
"""Acceptance-test app: one queue "q"; behaviour from FARMAPP_* environment variables."""
import asyncio
import os

import psycopg

from outbox_farm import Farm, Message

SLEEP = float(os.environ.get("FARMAPP_SLEEP", "0"))
LEDGER = os.environ.get("FARMAPP_LEDGER") == "1"
PREFETCH = os.environ.get("FARMAPP_PREFETCH")

farm = Farm(table="outbox", dlq_table="outbox_dlq")
_ledger = {}  # pid -> (lock, [connection]); made after the fork, in the worker that uses it


async def _connection():
    pid = os.getpid()
    if pid not in _ledger:
        _ledger[pid] = (asyncio.Lock(), [])
    lock, box = _ledger[pid]
    async with lock:
        if not box:
            box.append(
                await psycopg.AsyncConnection.connect(os.environ["FARMAPP_DSN"], autocommit=True)
            )
    return box[0]


@farm.handler(
    "q",
    concurrency=int(os.environ.get("FARMAPP_CONCURRENCY", "32")),
    prefetch=int(PREFETCH) if PREFETCH else None,
    lease_ttl=float(os.environ.get("FARMAPP_LEASE_TTL", "60")),
)
async def handle(msg: Message) -> None:
    if SLEEP:
        await asyncio.sleep(SLEEP)
    if LEDGER:
        conn = await _connection()
        await conn.execute("INSERT INTO ledger (id, pid) VALUES (%s, %s)", (msg.id, os.getpid()))
'''


# -- helpers ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without any OUTBOX_FARM_* / metrics-dir setting, plus `extra`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("OUTBOX_FARM_") and k != "PROMETHEUS_MULTIPROC_DIR"
    }
    env.update(extra)
    return env


def value(samples: list[Sample], name: str, **labels: str) -> float | None:
    """Sum of the samples called `name` whose labels include `labels`; None if there are none."""
    found = [
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return sum(found) if found else None


class RunningFarm:
    """One `outbox-farm start` subprocess (the arbiter) and what can be asked of it."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
        self.proc = proc
        self.port = port
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def get(self, path: str) -> tuple[int, bytes] | None:
        """(status, body), or None while nothing answers."""
        return get(f"http://127.0.0.1:{self.port}{path}")

    def health(self) -> tuple[int, dict[str, Any]] | None:
        got = self.get("/healthz")
        return None if got is None else (got[0], json.loads(got[1]))

    def samples(self) -> list[Sample]:
        got = self.get("/metrics")
        if got is None or got[0] != 200:
            return []
        return [
            sample
            for family in text_string_to_metric_families(got[1].decode())
            for sample in family.samples
        ]

    def metric(self, name: str, **labels: str) -> float | None:
        return value(self.samples(), name, **labels)

    def children(self) -> set[int]:
        """Live (non-zombie) worker processes of the arbiter (not its /metrics server or its
        short-lived hand-back processes: workers name themselves)."""
        try:
            kids = psutil.Process(self.pid).children()
        except psutil.NoSuchProcess:
            return set()
        live = set()
        for kid in kids:
            with contextlib.suppress(psutil.NoSuchProcess):
                if kid.status() != psutil.STATUS_ZOMBIE and kid.name() == WORKER_NAME:
                    live.add(kid.pid)
        return live

    def healthy(self, procs: int) -> bool:
        got = self.health()
        return got is not None and got[0] == 200 and got[1]["procs"] == got[1]["alive"] == procs

    def stop(self, timeout: float = GRACEFUL + 10) -> tuple[int, float]:
        """SIGTERM the arbiter; (exit status, seconds it took)."""
        began = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"arbiter still running {timeout}s after SIGTERM\n{self.log_tail()}")
        return code, time.monotonic() - began


@contextlib.contextmanager
def farm_process(
    tmp_path: Path,
    dsn: str,
    *args: str,
    name: str = "farm",
    procs: int = 2,
    app: str = "farmapp:farm",
    graceful: float = GRACEFUL,
    metrics_bind: str | None = None,
    **app_env: str,
) -> Iterator[RunningFarm]:
    """Start `outbox-farm start` in a new session; always kill its whole process group after.

    /metrics is on a free port of loopback unless `metrics_bind` says otherwise."""
    port = free_port()
    log_path = tmp_path / f"{name}.log"
    command = [
        str(CLI),
        "start",
        app,
        "--procs",
        str(procs),
        "--dsn",
        dsn,
        "--metrics-bind",
        metrics_bind or f"127.0.0.1:{port}",
        "--metrics-dir",
        str(tmp_path / f"{name}-metrics"),
        "--graceful-timeout",
        str(graceful),
        *args,
    ]
    # TMPDIR: the arbiter's state directory stays in tmp_path even when it is SIGKILLed.
    env = clean_env(FARMAPP_DSN=dsn, TMPDIR=str(tmp_path), **app_env)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command,
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        yield RunningFarm(proc, port, log_path)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def scalar(conn: psycopg.Connection[Any], query: str, params: Any = None) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def ledger_stats(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    """(ledger rows, distinct ids in the ledger)."""
    row = conn.execute("SELECT count(*), count(DISTINCT id) FROM ledger").fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    (tmp_path / "farmapp.py").write_text(FARMAPP)
    return tmp_path


@pytest.fixture
def ledger(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    conn.execute("CREATE TABLE ledger (id bigint NOT NULL, pid int NOT NULL)")
    return conn


def json_entries(text: str) -> list[dict[str, Any]]:
    """Every non-empty line of `text` parsed as a JSON object; AssertionError otherwise."""
    entries = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            entry = None
        assert isinstance(entry, dict), f"not a JSON object line: {line!r}"
        entries.append(entry)
    return entries


# -- 1. drain --------------------------------------------------------------------------------


def test_two_processes_drain_10000_rows_and_report_it(
    app_dir: Path, dsn: str, conn: psycopg.Connection[Any]
) -> None:
    publish(conn, 10_000, queue="q")
    began = time.monotonic()
    with farm_process(app_dir, dsn) as farm:
        backlog_seen: list[float] = []

        def drained() -> bool:
            samples = farm.samples()
            backlog = value(samples, "outbox_farm_backlog", queue="q")
            if backlog is not None:
                backlog_seen.append(backlog)
            return (value(samples, "outbox_farm_acked_total") or 0) >= 10_000

        wait_for(drained, "10,000 acks in /metrics", 45, farm)
        drain_seconds = time.monotonic() - began
        samples = farm.samples()
        assert value(samples, "outbox_farm_acked_total") == 10_000
        assert value(samples, "outbox_farm_acked_total", queue="q") == 10_000
        assert value(samples, "outbox_farm_processes") == 2
        assert scalar(conn, "SELECT count(*) FROM outbox") == 0
        assert scalar(conn, "SELECT count(*) FROM outbox_dlq") == 0
        # The gauges are refreshed every 5 s by one process: the backlog must fall to 0.
        wait_for(lambda: farm.metric("outbox_farm_backlog", queue="q") == 0, "backlog 0", 15, farm)
        assert max(backlog_seen, default=0) > 0, "the backlog gauge never showed the rows"
        assert farm.healthy(2)
        code, took = farm.stop()
    assert code == 0, farm.log_tail()
    print(f"drained 10,000 rows in {drain_seconds:.1f}s; SIGTERM exit in {took:.1f}s")


# -- 2. a child killed mid-run -----------------------------------------------------------------


def test_a_killed_child_is_replaced_and_no_row_is_lost(
    app_dir: Path, dsn: str, ledger: psycopg.Connection[Any]
) -> None:
    conn = ledger
    ids = publish(conn, 1000, queue="q")
    concurrency, prefetch = 8, 8
    capacity = concurrency + prefetch
    with farm_process(
        app_dir,
        dsn,
        FARMAPP_LEDGER="1",
        FARMAPP_SLEEP="0.1",
        FARMAPP_CONCURRENCY=str(concurrency),
        FARMAPP_PREFETCH=str(prefetch),
        FARMAPP_LEASE_TTL="2",
    ) as farm:
        wait_for(lambda: farm.healthy(2), "2 healthy workers", 30, farm)
        original = farm.children()
        assert len(original) == 2
        wait_for(lambda: ledger_stats(conn)[0] >= 150, "150 handled rows", 30, farm, every=0.02)
        by_pid = dict(conn.execute("SELECT pid, count(*) FROM ledger GROUP BY pid").fetchall())
        victim = max(original, key=lambda pid: by_pid.get(pid, 0))
        assert by_pid.get(victim, 0) > 0, "the victim never handled a row"
        os.kill(victim, signal.SIGKILL)
        assert scalar(conn, "SELECT count(*) FROM outbox") > 0, "not killed mid-run"

        def replaced() -> set[int]:
            kids = farm.children()
            return kids if len(kids) == 2 and victim not in kids and kids - original else set()

        kids = wait_for(replaced, "a replacement child", 30, farm)
        wait_for(lambda: farm.healthy(2), "2 healthy workers again", 30, farm)
        samples = farm.samples()
        assert value(samples, "outbox_farm_processes") == 2
        assert (value(samples, "outbox_farm_worker_restarts_total", reason="crash") or 0) >= 1
        wait_for(
            lambda: scalar(conn, "SELECT count(*) FROM outbox") == 0,
            "an empty outbox",
            40,
            farm,
            every=0.25,
        )
        total, distinct = ledger_stats(conn)
        handled = {int(r[0]) for r in conn.execute("SELECT DISTINCT id FROM ledger")}
        assert handled == set(ids), f"{len(set(ids) - handled)} rows never handled"
        assert scalar(conn, "SELECT count(*) FROM outbox_dlq") == 0
        duplicated = conn.execute(
            "SELECT id, array_agg(pid) FROM ledger GROUP BY id HAVING count(*) > 1"
        ).fetchall()
        samples = farm.samples()
        # Counters of dead processes survive in their files. The killed child may have died
        # between an ack's commit and its count; every claim beyond one per row is a row the
        # killed child held when it died.
        acked = value(samples, "outbox_farm_acked_total") or 0
        assert len(ids) - capacity <= acked <= len(ids)
        reclaimed = (value(samples, "outbox_farm_claimed_total") or 0) - len(ids)
        assert reclaimed >= 1, "the killed child held no rows"
        # Only rows the killed child had claimed (and handled, but not yet acked) run twice.
        assert total - distinct <= min(reclaimed, capacity), duplicated
        assert all(victim in pids for _, pids in duplicated), duplicated
        assert not value(samples, "outbox_farm_lease_lost_total")
        # The dead child's live gauge file was removed: nothing is reported in flight.
        assert value(samples, "outbox_farm_inflight", queue="q") == 0
        assert victim not in farm.children()
        assert kids == farm.children()
    print(
        f"killed {victim} holding {reclaimed:g} rows; replacement {kids - original}; "
        f"{total - distinct} duplicate(s)"
    )


SLOW_ACKS = """
CREATE FUNCTION slow_ack() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_sleep(1); RETURN NULL; END $$;
CREATE TRIGGER slow_ack BEFORE DELETE ON outbox FOR EACH STATEMENT EXECUTE FUNCTION slow_ack();
"""


def test_a_worker_never_holds_more_leased_rows_than_its_capacity(
    app_dir: Path, dsn: str, conn: psycopg.Connection[Any]
) -> None:
    publish(conn, 2000, queue="q")
    conn.execute(SLOW_ACKS)  # every ack statement takes 1 s: a slow or contended database
    concurrency, prefetch = 4, 4
    leased: list[int] = []
    with farm_process(
        app_dir,
        dsn,
        procs=1,
        FARMAPP_CONCURRENCY=str(concurrency),
        FARMAPP_PREFETCH=str(prefetch),
    ) as farm:
        wait_for(lambda: farm.healthy(1), "1 healthy worker", 30, farm)
        wait_for(
            lambda: scalar(conn, "SELECT count(*) FROM outbox WHERE acquired_token IS NOT NULL"),
            "a first claim",
            30,
            farm,
        )
        # Watched for 6 s (several slow acks) on purpose: the bound must hold at every moment,
        # so no condition ends the watch.
        end = time.monotonic() + 6
        while time.monotonic() < end:
            leased.append(
                scalar(conn, "SELECT count(*) FROM outbox WHERE acquired_token IS NOT NULL")
            )
            time.sleep(0.1)
        if farm.proc.poll() is not None:
            pytest.fail(f"farm exited\n{farm.log_tail()}")
    assert max(leased) <= concurrency + prefetch, f"up to {max(leased)} rows leased at once"


# -- 3. SIGTERM with slow handlers -------------------------------------------------------------


def test_sigterm_drains_gracefully_and_releases_unstarted_rows(
    app_dir: Path, dsn: str, ledger: psycopg.Connection[Any]
) -> None:
    conn = ledger
    ids = publish(conn, 200, queue="q")
    with farm_process(
        app_dir, dsn, FARMAPP_LEDGER="1", FARMAPP_SLEEP="1", FARMAPP_CONCURRENCY="4"
    ) as farm:
        wait_for(lambda: farm.healthy(2), "2 healthy workers", 30, farm)
        wait_for(lambda: ledger_stats(conn)[0] >= 8, "8 handled rows", 30, farm)
        # Both workers now hold claimed rows, some running, some waiting in the prefetch.
        assert scalar(conn, "SELECT count(*) FROM outbox WHERE acquired_token IS NOT NULL") > 0
        code, took = farm.stop()
        assert code == 0, farm.log_tail()
        assert took < GRACEFUL, f"took {took:.1f}s\n{farm.log_tail()}"
        assert farm.children() == set()
    leased = scalar(conn, "SELECT count(*) FROM outbox WHERE acquired_token IS NOT NULL")
    assert leased == 0, "rows still leased after a graceful stop"
    # Released rows got their delivery taken back: no row left counts a delivery.
    assert scalar(conn, "SELECT coalesce(max(deliveries_count), 0) FROM outbox") == 0
    remaining = scalar(conn, "SELECT count(*) FROM outbox")
    total, distinct = ledger_stats(conn)
    assert total == distinct == len(ids) - remaining
    assert 0 < remaining < len(ids)

    began = time.monotonic()
    with farm_process(app_dir, dsn, name="farm2", FARMAPP_LEDGER="1") as second:
        wait_for(
            lambda: scalar(conn, "SELECT count(*) FROM outbox") == 0,
            "the second farm to drain the rest",
            30,
            second,
            every=0.25,
        )
        rest = time.monotonic() - began
        code, _ = second.stop()
        assert code == 0, second.log_tail()
    assert ledger_stats(conn) == (len(ids), len(ids))
    print(f"SIGTERM exit in {took:.1f}s, {remaining} left; second farm drained them in {rest:.1f}s")


def test_sigterm_cancels_handlers_still_running_at_the_graceful_deadline(
    app_dir: Path, dsn: str, ledger: psycopg.Connection[Any]
) -> None:
    conn = ledger
    publish(conn, 100, queue="q")
    graceful, concurrency = 3.0, 4
    with farm_process(
        app_dir,
        dsn,
        graceful=graceful,
        FARMAPP_LEDGER="1",
        FARMAPP_SLEEP="30",
        FARMAPP_CONCURRENCY=str(concurrency),
    ) as farm:
        wait_for(lambda: farm.healthy(2), "2 healthy workers", 30, farm)
        # Each worker claims its capacity (concurrency + prefetch) and runs `concurrency`.
        wait_for(
            lambda: (
                scalar(conn, "SELECT count(*) FROM outbox WHERE acquired_token IS NOT NULL")
                == 2 * 2 * concurrency
            ),
            "both workers holding a full claim",
            30,
            farm,
        )
        # Every executor has started its row (a handler start is a delivery-lag sample).
        wait_for(
            lambda: (
                farm.metric("outbox_farm_delivery_lag_seconds_count", queue="q") == 2 * concurrency
            ),
            "a handler running on every executor",
            30,
            farm,
        )
        code, took = farm.stop()
    assert code == 0, farm.log_tail()
    # The arbiter would SIGKILL at graceful + 5 s; the workers must be done before that.
    assert graceful - 0.5 < took < graceful + 4, f"took {took:.1f}s\n{farm.log_tail()}"
    assert "still running at the stop deadline" in farm.log()
    assert ledger_stats(conn) == (0, 0)
    assert scalar(conn, "SELECT count(*) FROM outbox") == 100
    assert scalar(conn, "SELECT count(*) FROM outbox WHERE acquired_token IS NOT NULL") == 0
    # Cancelled handlers count an attempt and keep their delivery; released rows keep neither.
    ran = conn.execute(
        "SELECT count(*) FILTER (WHERE attempts_count = 1 AND deliveries_count = 1), "
        "count(*) FILTER (WHERE attempts_count = 0 AND deliveries_count = 0) FROM outbox"
    ).fetchone()
    assert ran == (2 * concurrency, 100 - 2 * concurrency)
    print(f"SIGTERM with handlers past the {graceful:g}s deadline: exit in {took:.1f}s")


# -- 4. TTIN / TTOU / HUP ----------------------------------------------------------------------


def test_ttin_ttou_resize_and_hup_replaces_every_child_without_loss(
    app_dir: Path, dsn: str, ledger: psycopg.Connection[Any]
) -> None:
    conn = ledger
    published: list[int] = []

    def publish_next() -> None:
        published.extend(publish(conn, [{"n": len(published)}], queue="q"))

    with farm_process(
        app_dir, dsn, FARMAPP_LEDGER="1", FARMAPP_SLEEP="0.01", FARMAPP_CONCURRENCY="8"
    ) as farm:

        def settled(procs: int) -> bool:
            return (
                farm.healthy(procs)
                and farm.metric("outbox_farm_processes") == procs
                and len(farm.children()) == procs
            )

        wait_for(lambda: settled(2), "2 workers", 30, farm)
        farm.proc.send_signal(signal.SIGTTIN)
        wait_for(lambda: settled(3), "3 workers after TTIN", 30, farm)
        farm.proc.send_signal(signal.SIGTTOU)
        wait_for(lambda: settled(2), "2 workers after TTOU", 30, farm)

        old = farm.children()
        farm.proc.send_signal(signal.SIGHUP)

        def rolled() -> set[int]:
            publish_next()  # a row every 20 ms: the roll happens under load
            kids = farm.children()
            return kids if len(kids) == 2 and not kids & old and farm.healthy(2) else set()

        new = wait_for(rolled, f"HUP to replace {old}", 30, farm, every=0.02)
        for _ in range(20):  # and a little more load after the roll, paced the same on purpose
            publish_next()
            time.sleep(0.02)
        wait_for(
            lambda: scalar(conn, "SELECT count(*) FROM outbox") == 0,
            "every published row handled",
            20,
            farm,
            every=0.25,
        )
        handled = {int(r[0]) for r in conn.execute("SELECT DISTINCT id FROM ledger")}
        lost = set(published) - handled
        assert not lost, f"{len(lost)} of {len(published)} published rows never handled"
        total, distinct = ledger_stats(conn)
        assert total == distinct, "a graceful roll delivered rows twice"
        assert farm.metric("outbox_farm_processes") == 2
        assert farm.children() == new
        code, _ = farm.stop()
    assert code == 0, farm.log_tail()
    print(f"HUP replaced {sorted(old)} by {sorted(new)}; {len(published)} rows published")


def test_workers_stop_when_the_arbiter_dies(app_dir: Path, dsn: str) -> None:
    with farm_process(app_dir, dsn) as farm:
        wait_for(lambda: farm.healthy(2), "2 healthy workers", 30, farm)
        workers = farm.children()
        os.kill(farm.pid, signal.SIGKILL)
        farm.proc.wait(timeout=10)

        def running() -> set[int]:
            alive = set()
            for pid in workers:
                with contextlib.suppress(psutil.NoSuchProcess):
                    if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                        alive.add(pid)
            return alive

        wait_for(lambda: not running(), "the orphaned workers to stop", 10, every=0.2)


# -- 5. start-up failures ----------------------------------------------------------------------

NOT_A_FARM = "farm = {'not': 'a farm'}\n"
BOOM = "raise RuntimeError('kaboom at import')\n"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("missing_module", ["nosuchmodule"]),
        ("not_a_farm", ["notafarm:farm", "not an outbox_farm.Farm"]),
        ("raises_at_import", ["boomapp", "RuntimeError", "kaboom at import"]),
        ("bad_dsn", ["cannot connect", "port=1"]),
        ("unmigrated", ["outbox", "do not exist", "outbox-farm migrate"]),
    ],
)
def test_startup_failures_exit_nonzero_with_a_clear_message(
    request: pytest.FixtureRequest, app_dir: Path, case: str, expected: list[str]
) -> None:
    (app_dir / "notafarm.py").write_text(NOT_A_FARM)
    (app_dir / "boomapp.py").write_text(BOOM)
    app = {
        "missing_module": "nosuchmodule:farm",
        "not_a_farm": "notafarm:farm",
        "raises_at_import": "boomapp:farm",
    }.get(case, "farmapp:farm")
    if case == "bad_dsn":
        dsn = "host=127.0.0.1 port=1 user=postgres dbname=nothing connect_timeout=5"
    elif case == "unmigrated":
        dsn = request.getfixturevalue("empty_dsn")
    else:
        dsn = request.getfixturevalue("dsn")
    began = time.monotonic()
    with farm_process(app_dir, dsn, app=app) as farm:
        try:
            code = farm.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{case}: still running after 10s\n{farm.log_tail()}")
    took = time.monotonic() - began
    output = farm.log()
    assert code != 0, output
    for text in expected:
        assert text in output, f"{text!r} not in:\n{output}"
    assert "Traceback" not in output, output
    assert farm.children() == set()
    print(f"{case}: exit {code} in {took:.1f}s: {output.strip().splitlines()[-1]}")


# -- 6. JSON logs ------------------------------------------------------------------------------


def test_log_format_json_writes_one_json_object_per_line(app_dir: Path, dsn: str) -> None:
    with farm_process(app_dir, dsn, "--log-format", "json") as farm:
        wait_for(lambda: farm.healthy(2), "2 healthy workers", 30, farm)
        wait_for(lambda: farm.log().count('"started"') >= 2, "2 started events", 10, farm)
        code, _ = farm.stop()
    assert code == 0, farm.log_tail()
    entries = json_entries(farm.log())
    for entry in entries:
        assert {"ts", "level", "logger", "pid", "message", "event"} <= entry.keys(), entry
    events = [(e["event"], e["pid"]) for e in entries]
    assert ("arbiter_started", farm.pid) in events
    assert ("arbiter_stopped", farm.pid) in events
    workers = {pid for event, pid in events if event == "started"}
    assert len(workers) == 2, events
    assert farm.pid not in workers, events


def test_log_format_json_stays_json_with_migrate(app_dir: Path, empty_dsn: str) -> None:
    with farm_process(app_dir, empty_dsn, "--log-format", "json", "--migrate") as farm:
        wait_for(lambda: farm.healthy(2), "2 healthy workers", 30, farm)
        code, _ = farm.stop()
    if code != 0:
        pytest.fail(f"exit {code}\n{farm.log_tail()}")
    json_entries(farm.log())


def test_log_format_json_gives_signal_handling_lines_an_event(app_dir: Path, dsn: str) -> None:
    with farm_process(app_dir, dsn, "--log-format", "json", procs=1) as farm:
        wait_for(lambda: farm.healthy(1), "1 healthy worker", 30, farm)
        farm.proc.send_signal(signal.SIGTTIN)
        wait_for(lambda: farm.healthy(2), "2 workers after TTIN", 30, farm)
        farm.proc.send_signal(signal.SIGTTOU)
        wait_for(lambda: len(farm.children()) == 1, "1 worker after TTOU", 30, farm)
        old = farm.children()
        farm.proc.send_signal(signal.SIGHUP)
        wait_for(
            lambda: len(kids := farm.children()) == 1 and not kids & old,
            "a new worker after HUP",
            30,
            farm,
        )
        code, _ = farm.stop()
    if code != 0:
        pytest.fail(f"exit {code}\n{farm.log_tail()}")
    entries = json_entries(farm.log())
    messages = [e["message"] for e in entries]
    if not any(m.startswith(("TTIN", "TTOU", "HUP")) for m in messages):
        pytest.fail(f"no TTIN / TTOU / HUP lines logged: {messages}")
    no_event = [e["message"] for e in entries if "event" not in e]
    assert no_event == []


# -- 7. --help -----------------------------------------------------------------------------------


def test_start_help_names_every_options_environment_variable() -> None:
    from outbox_farm.cli import main

    result = subprocess.run(
        [str(CLI), "start", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(),
        check=False,
    )
    assert result.returncode == 0, result.stderr
    start = main.commands["start"]
    envvars = []
    for param in start.params:
        if isinstance(param, click.Option) and param.envvar:
            names = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar)
            envvars.extend(names)
    assert len(envvars) >= 12
    missing = [name for name in envvars if name not in result.stdout]
    assert missing == [], result.stdout
    for name in (
        "OUTBOX_FARM_DSN",
        "OUTBOX_FARM_PROCS",
        "OUTBOX_FARM_CONCURRENCY",
        "OUTBOX_FARM_QUEUES",
        "OUTBOX_FARM_GRACEFUL_TIMEOUT",
        "OUTBOX_FARM_HEARTBEAT_TIMEOUT",
        "OUTBOX_FARM_POLL_INTERVAL",
        "OUTBOX_FARM_METRICS_BIND",
        "PROMETHEUS_MULTIPROC_DIR",
        "OUTBOX_FARM_MIGRATE",
        "OUTBOX_FARM_LOG_FORMAT",
        "OUTBOX_FARM_LOG_LEVEL",
    ):
        assert name in result.stdout, name
