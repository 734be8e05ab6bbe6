"""The farm survives its own workers: crashes, poison messages, deploys.

Real `outbox-farm start` subprocesses (helpers from `test_farm`), a real database, and an app
(`faultapp.py`, written per test) whose queues misbehave on purpose:

- `q`: records every row it handles in `ledger(id, pid, version)`; `version` is the app file's
  VERSION constant, so a test can tell which code ran a row.
- `exit`: the handler calls `os._exit(1)`: the worker dies holding its rows.
- `block`: an async handler that blocks the event loop: the arbiter kills the worker for a
  silent heartbeat.

Each poison queue has `max_deliveries=POISON_MAX`, so a poison row kills exactly that many
workers and then goes to the DLQ without running again.
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.acceptance.test_farm import farm_process, ledger_stats, scalar, value
from tests.steps import publish, wait_for

pytestmark = pytest.mark.slow

FAULTAPP = '''\
"""Fault-injection app for the farm's acceptance tests."""
import os
import time

import psycopg

from outbox_farm import Farm, Message

VERSION = {version!r}
POISON_MAX = int(os.environ.get("FAULTAPP_POISON_MAX", "1"))
farm = Farm(table="outbox", dlq_table="outbox_dlq")
_conn = []


@farm.handler("q", concurrency=8, lease_ttl=float(os.environ.get("FAULTAPP_LEASE_TTL", "60")))
def handle(msg: Message) -> None:
    if not _conn:
        _conn.append(psycopg.connect(os.environ["FARMAPP_DSN"], autocommit=True))
    _conn[0].execute(
        "INSERT INTO ledger (id, pid, version) VALUES (%s, %s, %s)",
        (msg.id, os.getpid(), VERSION),
    )


@farm.handler("exit", concurrency=1, max_deliveries=POISON_MAX)
async def poison_exit(msg: Message) -> None:
    os._exit(1)


@farm.handler("block", concurrency=1, max_deliveries=POISON_MAX)
async def poison_block(msg: Message) -> None:
    time.sleep(60)  # blocks the event loop: no heartbeat
'''


def write_app(folder: Path, version: str) -> None:
    # A different length each time, so a .pyc written in the same second is never reused.
    (folder / "faultapp.py").write_text(FAULTAPP.format(version=version))


@pytest.fixture
def fault_dir(tmp_path: Path) -> Path:
    write_app(tmp_path, "v1")
    return tmp_path


@pytest.fixture
def ledger(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    conn.execute("CREATE TABLE ledger (id bigint NOT NULL, pid int NOT NULL, version text)")
    return conn


class SteadyLoad:
    """Publishes `rate` rows a second into queue `q` from a thread, until stopped."""

    def __init__(self, dsn: str, rate: float) -> None:
        self.dsn, self.rate = dsn, rate
        self.ids: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self._stop.wait(0.1):
                self.ids += publish(conn, max(1, int(self.rate / 10)), queue="q")

    def __enter__(self) -> SteadyLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def restarts(farm: Any) -> dict[str, float]:
    samples = farm.samples()
    return {
        reason: value(samples, "outbox_farm_worker_restarts_total", reason=reason) or 0
        for reason in ("crash", "heartbeat", "boot")
    }


@pytest.mark.one_server
def test_twenty_crashes_of_every_kind_never_stop_the_farm(
    fault_dir: Path, dsn: str, ledger: psycopg.Connection[Any]
) -> None:
    """12 SIGKILLs from outside, 4 handlers calling os._exit, 4 blocked event loops, over
    about a minute at steady load: the farm runs on, every row is handled, and the restart
    counter says 16 crashes and 4 heartbeat kills."""
    conn = ledger
    rng = random.Random(7)
    with farm_process(
        fault_dir, dsn, "--heartbeat-timeout", "2", app="faultapp:farm", FAULTAPP_POISON_MAX="1"
    ) as farm:
        wait_for(lambda: farm.healthy(2), "2 healthy workers", 30, farm)
        began = time.monotonic()
        with SteadyLoad(dsn, 100) as load:
            plan = ["kill"] * 12 + ["exit"] * 4 + ["block"] * 4
            rng.shuffle(plan)
            for step, cause in enumerate(plan, 1):
                before = sum(restarts(farm).values())
                if cause == "kill":
                    os.kill(rng.choice(sorted(farm.children())), signal.SIGKILL)
                else:
                    publish(conn, 1, queue=cause)
                wait_for(
                    lambda before=before: sum(restarts(farm).values()) > before,
                    f"restart #{step} ({cause})",
                    30,
                    farm,
                    every=0.2,
                )
                wait_for(lambda: farm.healthy(2), f"2 healthy workers after #{step}", 30, farm)
                time.sleep(rng.uniform(1.5, 3.0))  # paces 20 deaths over about a minute
        took = time.monotonic() - began
        wait_for(
            lambda: scalar(conn, "SELECT count(*) FROM outbox") == 0,
            "an empty outbox",
            60,
            farm,
            every=0.5,
        )
        handled = {int(r[0]) for r in conn.execute("SELECT DISTINCT id FROM ledger")}
        lost = set(load.ids) - handled
        assert not lost, f"{len(lost)} of {len(load.ids)} rows never handled"
        counts = restarts(farm)
        assert counts == {"crash": 16, "heartbeat": 4, "boot": 0}, (counts, farm.log_tail())
        dlq = dict(conn.execute("SELECT queue, count(*) FROM outbox_dlq GROUP BY queue").fetchall())
        assert dlq == {"exit": 4, "block": 4}
        reasons = {r[0] for r in conn.execute("SELECT DISTINCT failure_reason FROM outbox_dlq")}
        assert reasons == {"max_deliveries"}
        log = farm.log()
        assert "event=halt" not in log
        assert "event=worker_died" in log
        assert "killed by signal 9 (SIGKILL): out of memory? see dmesg" in log  # the test's kills
        assert "killed by signal 9 (SIGKILL) by the arbiter: its heartbeat" in log  # the blocks
        total, distinct = ledger_stats(conn)
        print(
            f"{len(load.ids)} rows at steady load, 20 deaths in {took:.0f}s {counts}, "
            f"{total - distinct} duplicates"
        )
        code, _ = farm.stop()
    assert code == 0, farm.log_tail()


def test_a_poison_message_that_kills_its_worker_reaches_the_dlq_in_seconds(
    fault_dir: Path, dsn: str, ledger: psycopg.Connection[Any]
) -> None:
    """With the default 60 s lease, only handing the dead worker's rows back at once gets a
    row that kills its worker three times to the DLQ in seconds."""
    conn = ledger
    with farm_process(fault_dir, dsn, app="faultapp:farm", FAULTAPP_POISON_MAX="3") as farm:
        wait_for(lambda: farm.healthy(2), "2 healthy workers", 30, farm)
        began = time.monotonic()
        (row,) = publish(conn, 1, queue="exit")
        found = wait_for(
            lambda: conn.execute(
                "SELECT failure_reason, deliveries_count FROM outbox_dlq WHERE original_id = %s",
                [row],
            ).fetchone(),
            "the poison row in the DLQ",
            30,
            farm,
            every=0.2,
        )
        took = time.monotonic() - began
        assert found == ("max_deliveries", 4)
        assert restarts(farm)["crash"] == 3
        wait_for(lambda: farm.healthy(2), "2 healthy workers", 30, farm)
        ids = publish(conn, 50, queue="q")
        wait_for(lambda: ledger_stats(conn)[1] == 50, "50 rows handled after", 30, farm)
        assert {int(r[0]) for r in conn.execute("SELECT id FROM ledger")} == set(ids)
        assert "leases_released" in farm.log()
    print(f"poison row dead-lettered after 3 worker deaths in {took:.1f}s")


def _new_workers(farm: Any, old: set[int]) -> set[int]:
    kids = farm.children()
    return kids if len(kids) == 2 and not kids & old and farm.healthy(2) else set()


def _versions(conn: psycopg.Connection[Any], ids: list[int]) -> set[str]:
    rows = conn.execute("SELECT DISTINCT version FROM ledger WHERE id = ANY(%s)", [ids])
    return {r[0] for r in rows}


@pytest.mark.parametrize("preload", [False, True], ids=["fresh-import", "preload"])
def test_hup_rolls_out_the_code_on_disk_unless_preloaded(
    fault_dir: Path, dsn: str, ledger: psycopg.Connection[Any], preload: bool
) -> None:
    conn = ledger
    args = ["--preload"] if preload else []
    with farm_process(fault_dir, dsn, *args, app="faultapp:farm") as farm:
        wait_for(lambda: farm.healthy(2), "2 healthy workers", 30, farm)
        first = publish(conn, 20, queue="q")
        wait_for(lambda: ledger_stats(conn)[1] == 20, "20 rows handled", 30, farm)
        assert _versions(conn, first) == {"v1"}
        write_app(fault_dir, "version-two")
        old = farm.children()
        farm.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: _new_workers(farm, old), "2 new workers after HUP", 30, farm)
        second = publish(conn, 20, queue="q")
        wait_for(lambda: ledger_stats(conn)[1] == 40, "40 rows handled", 30, farm)
        assert _versions(conn, second) == ({"v1"} if preload else {"version-two"})
        assert restarts(farm) == {"crash": 0, "heartbeat": 0, "boot": 0}
        code, _ = farm.stop()
    assert code == 0, farm.log_tail()


def test_a_broken_deploy_keeps_the_running_workers(
    fault_dir: Path, dsn: str, ledger: psycopg.Connection[Any]
) -> None:
    conn = ledger
    with farm_process(fault_dir, dsn, app="faultapp:farm") as farm:
        wait_for(lambda: farm.healthy(2), "2 healthy workers", 30, farm)
        old = farm.children()
        (fault_dir / "faultapp.py").write_text("raise RuntimeError('half-deployed')\n")
        farm.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "rolling_restart_failed" in farm.log(), "the roll abandoned", 30, farm)
        assert farm.children() == old
        ids = publish(conn, 20, queue="q")
        wait_for(lambda: ledger_stats(conn)[1] == 20, "rows handled by old workers", 30, farm)
        assert _versions(conn, ids) == {"v1"}
        assert "half-deployed" in farm.log()
        code, _ = farm.stop()
    assert code == 0, farm.log_tail()


def test_reload_replaces_the_workers_when_a_source_file_changes(
    fault_dir: Path, dsn: str, ledger: psycopg.Connection[Any]
) -> None:
    conn = ledger
    with farm_process(fault_dir, dsn, "--reload", app="faultapp:farm") as farm:
        wait_for(lambda: farm.healthy(2), "2 healthy workers", 30, farm)
        old = farm.children()
        source = fault_dir / "faultapp.py"
        written = source.stat().st_mtime
        write_app(fault_dir, "reloaded")
        os.utime(source, (written + 2, written + 2))  # a new mtime, whatever the resolution
        wait_for(lambda: _new_workers(farm, old), "2 new workers after the edit", 30, farm)
        ids = publish(conn, 10, queue="q")
        wait_for(lambda: ledger_stats(conn)[1] == 10, "10 rows handled", 30, farm)
        assert _versions(conn, ids) == {"reloaded"}
        code, _ = farm.stop()
    assert code == 0, farm.log_tail()


def test_healthz_is_503_with_the_reason_while_a_permanent_error_lasts(
    fault_dir: Path, dsn: str, ledger: psycopg.Connection[Any]
) -> None:
    """A renamed outbox table is not a passing fault: /healthz says so until it is back."""
    conn = ledger
    with farm_process(fault_dir, dsn, "--poll-interval", "0.1", app="faultapp:farm") as farm:
        wait_for(lambda: farm.healthy(2), "2 healthy workers", 30, farm)
        conn.execute("ALTER TABLE outbox RENAME TO outbox_elsewhere")

        def unhealthy() -> dict[str, Any] | None:
            got = farm.health()
            return got[1] if got is not None and got[0] == 503 else None

        detail = wait_for(unhealthy, "/healthz 503", 30, farm)
        assert any("outbox" in p and "does not exist" in p for p in detail["problems"]), detail
        assert detail["alive"] == 2
        assert "event=permanent_error" in farm.log()
        conn.execute("ALTER TABLE outbox_elsewhere RENAME TO outbox")
        wait_for(lambda: farm.healthy(2), "/healthz 200 again", 30, farm)
        ids = publish(conn, 10, queue="q")
        wait_for(lambda: ledger_stats(conn)[1] == 10, "10 rows handled after", 30, farm)
        assert {int(r[0]) for r in conn.execute("SELECT id FROM ledger")} == set(ids)
        code, _ = farm.stop()
    assert code == 0, farm.log_tail()


def test_metrics_bind_port_zero_logs_the_port_actually_bound(fault_dir: Path, dsn: str) -> None:
    with farm_process(
        fault_dir, dsn, app="faultapp:farm", procs=1, metrics_bind="127.0.0.1:0"
    ) as farm:
        found = wait_for(
            # The port and what follows it: a line half written would give half a port.
            lambda: re.search(r"metrics on 127\.0\.0\.1:(\d+)[ ,]", farm.log()),
            "the bound port in the log",
            30,
            farm,
        )
        port = int(found.group(1))
        assert port != 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            assert reply.status == 200
        code, _ = farm.stop()
    assert code == 0, farm.log_tail()
