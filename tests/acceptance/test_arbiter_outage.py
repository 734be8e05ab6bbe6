"""The arbiter outlives its environment: a database it cannot reach, workers that get stuck.

Real processes throughout: the arbiter and its workers, a real database (reached directly, or
through a TCP relay the test cuts and restores), and the helpers of `test_farm`. Every wait is
a deadline-bounded poll for a condition.

- A worker whose database is unreachable at boot does not fail to boot: it keeps beating,
  reports "database unreachable" through /healthz (503), and starts once the database answers.
  Killing such workers again and again is a crash each time, never a reason for the farm to
  give up (exit status 3).
- A worker whose event loop is blocked leaves its Python stacks in the log before it is killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.acceptance.test_farm import (
    FARMAPP,
    RunningFarm,
    clean_env,
    farm_process,
    free_port,
    scalar,
)
from tests.acceptance.test_worker_faults import FAULTAPP
from tests.steps import publish, wait_for

pytestmark = pytest.mark.slow

CLOSED = "host=127.0.0.1 port=1 user=postgres dbname=nothing connect_timeout=5"
ROUNDS = 3  # of killing every worker: more kills than the boot failures that make a farm give up
GRACEFUL = 10.0

# Runs the arbiter as `outbox-farm start` would, minus start's own database check (which
# refuses to begin against a database it cannot reach): argv is DSN, metrics port, procs.
DRIVER = """\
import sys
from pathlib import Path

from outbox_farm.cli.log_setup import configure
from outbox_farm.prefork.metrics_dir import prepare_metrics_dir

configure("text", "INFO")
prepare_metrics_dir(str(Path("metrics").absolute()))

from outbox_farm.prefork.arbiter import Arbiter
from outbox_farm.settings import SupervisorSettings

sys.path.insert(0, "")
import farmapp

state = Path("state")
state.mkdir()
settings = SupervisorSettings(
    procs=int(sys.argv[3]), graceful_timeout=10.0, metrics_bind=f"127.0.0.1:{sys.argv[2]}"
)
sys.exit(Arbiter(farmapp.farm, sys.argv[1], state.absolute(), settings).run())
"""


@contextlib.contextmanager
def arbiter_on(folder: Path, dsn: str, procs: int) -> Iterator[RunningFarm]:
    """The arbiter with `procs` workers of farmapp against `dsn`, in its own session."""
    (folder / "farmapp.py").write_text(FARMAPP)
    (folder / "driver.py").write_text(DRIVER)
    port = free_port()
    log_path = folder / "arbiter.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "driver.py", dsn, str(port), str(procs)],
            cwd=folder,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=clean_env(FARMAPP_DSN=dsn, TMPDIR=str(folder)),
            start_new_session=True,
        )
    try:
        yield RunningFarm(proc, port, log_path)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def unreachable(farm: RunningFarm, procs: int, *texts: str) -> bool:
    """/healthz is 503 naming the unreachable database (and `texts`), with `procs` workers
    running."""
    got = farm.health()
    if got is None or got[0] != 503:
        return False
    problems = " ".join(got[1].get("problems", []))
    return (
        "database unreachable" in problems
        and all(text in problems for text in texts)
        and len(farm.children()) == procs
    )


def kill_workers_again_and_again(farm: RunningFarm, procs: int, *texts: str) -> None:
    """SIGKILL every worker, `ROUNDS` times, each time once all replacements run and /healthz
    reports the outage."""
    for _ in range(ROUNDS):
        victims = farm.children()
        for victim in victims:
            os.kill(victim, signal.SIGKILL)

        def replaced(victims: set[int] = victims) -> bool:
            return not victims & farm.children() and unreachable(farm, procs, *texts)

        wait_for(replaced, "replacements waiting for the database", 30, farm)


def test_a_worker_that_cannot_reach_its_database_waits_unready_instead_of_failing_to_boot(
    tmp_path: Path,
) -> None:
    with arbiter_on(tmp_path, CLOSED, procs=2) as farm:
        wait_for(
            lambda: unreachable(farm, 2, "Connection refused"),
            "/healthz 503 naming the unreachable database",
            30,
            farm,
        )
        kill_workers_again_and_again(farm, 2, "Connection refused")
        health = farm.health()
        assert health is not None
        assert health[1]["alive"] == 0, health
        log = farm.log()
        assert "giving up" not in log, log
        assert "failed to boot" not in log, log
        assert "database_unreachable" in log or "waiting for it" in log, log
        # Waiting workers hold nothing: they stop at once.
        code, took = farm.stop(timeout=GRACEFUL + 10)
    assert code == 0, farm.log_tail()
    assert took < GRACEFUL, f"{took:.1f}s\n{farm.log_tail()}"


class Relay:
    """A TCP relay from a loopback port to the database, which the test cuts (connections
    refused, the open ones reset) and restores on the same port: a database restart, as the
    farm sees it."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()

    def restore(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def cut(self) -> None:
        assert self._listener is not None
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self._open.clear()

    def _connect(self) -> socket.socket:
        """A connection to the database: TCP, or its Unix socket when the host is a directory
        (the embedded server the suite may run on listens only there)."""
        host, port = self.target
        if host.startswith("/"):
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            unix.connect(f"{host}/.s.PGSQL.{port}")
            return unix
        return socket.create_connection(self.target)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = self._connect()
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open |= {client, server}
            for one, other in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(one, other), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


@pytest.fixture
def relay(dsn: str) -> Iterator[Relay]:
    params = conninfo_to_dict(dsn)
    made = Relay((str(params.get("host", "127.0.0.1")), int(str(params.get("port", 5432)))))
    made.restore()
    yield made
    made.cut()


def test_a_database_restart_while_workers_die_is_waited_out_and_everything_is_delivered(
    tmp_path: Path, dsn: str, conn: psycopg.Connection[Any], relay: Relay
) -> None:
    (tmp_path / "farmapp.py").write_text(FARMAPP)
    relayed = make_conninfo(dsn, host="127.0.0.1", port=relay.port, connect_timeout=5)
    with farm_process(tmp_path, relayed, graceful=GRACEFUL) as farm:
        wait_for(lambda: farm.healthy(2), "2 healthy workers", 30, farm)
        relay.cut()
        kill_workers_again_and_again(farm, 2)
        publish(conn, 500, queue="q")  # published during the outage, straight to the database
        relay.restore()
        wait_for(lambda: farm.healthy(2), "2 healthy workers after the outage", 60, farm)
        wait_for(
            lambda: scalar(conn, "SELECT count(*) FROM outbox") == 0,
            "every row delivered",
            60,
            farm,
        )
        assert "giving up" not in farm.log()
        code, _ = farm.stop()
    assert code == 0, farm.log_tail()


def test_a_worker_with_a_blocked_event_loop_leaves_its_stacks_in_the_log(
    tmp_path: Path, dsn: str, conn: psycopg.Connection[Any]
) -> None:
    (tmp_path / "faultapp.py").write_text(FAULTAPP.format(version="v1"))
    with farm_process(
        tmp_path, dsn, "--heartbeat-timeout", "2", app="faultapp:farm", procs=1
    ) as farm:
        wait_for(lambda: farm.healthy(1), "a healthy worker", 30, farm)
        (stuck,) = farm.children()
        publish(conn, 1, queue="block")
        wait_for(
            lambda: stuck not in farm.children() and farm.healthy(1),
            "the stuck worker replaced",
            60,
            farm,
        )
        log = farm.log()
        stuck_at = log.index(f"worker {stuck} sent no heartbeat")
        dump = log[stuck_at:]
        # faulthandler's dump: every thread, the event loop's blocked in the handler.
        assert "Thread 0x" in dump or "Current thread 0x" in dump, dump
        assert "in poison_block" in dump, dump
        assert "faultapp.py" in dump, dump
        code, _ = farm.stop()
    assert code == 0, farm.log_tail()
