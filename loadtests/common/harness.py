"""What the benchmarks, the load test and the chaos and scale suites stand on: a server, a
scratch database on it, the farm as a real `outbox-farm start` subprocess, and what its
/metrics says.

Both measure the farm the way a user runs it and must leave the server as they found it
whatever happens in between (a failed phase, a time limit, Ctrl-C), so the database's drop,
the farm's stop and the embedded server's cleanup are written once, here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import psycopg
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from psycopg.conninfo import conninfo_to_dict

from outbox_farm.db import scratch
from outbox_farm.dsn import redact
from outbox_farm.names import TableNames
from outbox_farm.ops.migrate import migrate

CLI = Path(sys.executable).parent / "outbox-farm"


class SetupError(Exception):
    """The run could not be set up: nothing was measured."""


def note(line: str) -> None:
    """Progress and diagnostics go to stderr: stdout carries only the report (or its JSON)."""
    print(line, file=sys.stderr, flush=True)


# -- the server and the scratch database -----------------------------------------------------


def reachable(dsn: str) -> str | None:
    """None when a connection works, else why not."""
    try:
        with psycopg.connect(dsn, connect_timeout=3):
            return None
    except psycopg.Error as exc:
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


@contextlib.contextmanager
def admin_server(
    given: str | None,
    fallbacks: Sequence[str | None] = (),
    say: Callable[[str], None] = note,
) -> Iterator[str]:
    """An admin DSN: `given` (it must answer), else the first of `fallbacks` that answers,
    else a throw-away embedded Postgres, removed on the way out."""
    if given:
        problem = reachable(given)
        if problem:
            raise SetupError(f"cannot connect to --dsn {redact(given)}: {problem}")
        yield given
        return
    for candidate in fallbacks:
        if not candidate:
            continue
        problem = reachable(candidate)
        if problem is None:
            yield candidate
            return
        say(f"{redact(candidate)} is not reachable ({problem})")
    from outbox_farm.ops.embedded import start_embedded

    data = Path(tempfile.mkdtemp(prefix="outbox-farm-scratch-pg-")) / "pgdata"
    say(f"no server given: starting an embedded Postgres in {data}")
    url, handle = start_embedded(data, delete=True)
    try:
        yield url
    finally:
        handle.cleanup()
        shutil.rmtree(data.parent, ignore_errors=True)


def dbname(dsn: str) -> str:
    return str(conninfo_to_dict(dsn)["dbname"])


@contextlib.contextmanager
def scratch_database(
    admin: str,
    names: TableNames,
    *,
    prefix: str,
    prepare: Callable[[psycopg.Connection[Any]], None] | None = None,
    keep: bool = False,
) -> Iterator[str]:
    """A new database beside `admin`'s, migrated for `names` (then `prepare`d), dropped WITH
    (FORCE) on the way out unless `keep`: a run that died leaves no connection to wait for."""

    def migrated(conn: psycopg.Connection[Any]) -> None:
        migrate(conn, names)
        if prepare is not None:
            prepare(conn)

    with scratch.scratch_database(admin, prefix, prepare=migrated, keep=keep) as dsn:
        yield dsn


# -- the farm under test ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def listening(port: int) -> bool:
    """Whether something accepts connections on loopback `port` (a broker that started)."""
    try:
        socket.create_connection(("127.0.0.1", port), 0.5).close()
    except OSError:
        return False
    return True


def start_farm(
    app: str,
    dsn: str,
    procs: int,
    *,
    cwd: Path,
    log: Path,
    options: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """`outbox-farm start app` in a session of its own, so that `kill_farm` reaches its
    workers too; its output goes to `log`."""
    command = [str(CLI), "start", app, "--dsn", dsn, "--procs", str(procs), *options]
    with log.open("wb") as out:
        return subprocess.Popen(
            command,
            cwd=cwd,
            env=None if env is None else dict(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop_farm(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """SIGTERM (the graceful stop) and wait; its exit status, or None if it had to be killed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_farm(proc)
        return None


def kill_farm(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the farm's whole session: the arbiter and every worker."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


class Metrics:
    """One scrape of the farm's /metrics."""

    def __init__(self, samples: Iterable[Sample]) -> None:
        self.samples = list(samples)

    @classmethod
    def parse(cls, text: str) -> Metrics:
        return cls(
            sample for family in text_string_to_metric_families(text) for sample in family.samples
        )

    @classmethod
    def scrape(cls, url: str, timeout: float = 5.0) -> Metrics | None:
        """The scrape, or None while nothing answers."""
        try:
            with urllib.request.urlopen(url, timeout=timeout) as reply:
                return cls.parse(reply.read().decode())
        except (OSError, urllib.error.URLError, ValueError):
            return None

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples called `name` whose labels include `labels` (0 when none)."""
        return sum(
            s.value
            for s in self.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def by(self, name: str, *keys: str) -> dict[tuple[str, ...], float]:
        """Samples called `name` summed by the values of the labels `keys`."""
        out: dict[tuple[str, ...], float] = defaultdict(float)
        for s in self.samples:
            if s.name == name:
                out[tuple(s.labels.get(k, "") for k in keys)] += s.value
        return dict(out)

    def counters(self) -> tuple[tuple[str, tuple[tuple[str, str], ...], float], ...]:
        """Every counter sample, for telling whether anything still moves."""
        return tuple(
            sorted(
                (s.name, tuple(sorted(s.labels.items())), s.value)
                for s in self.samples
                if s.name.endswith("_total")
            )
        )


# -- text tables -----------------------------------------------------------------------------


def align(rows: Sequence[Sequence[str]], left: int = 2) -> list[str]:
    """Rows as lines of columns two spaces apart: names (the first `left`) to the left,
    figures to the right, so that figures of one column line up digit by digit."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.ljust(width) if i < left else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
