"""The Postgres server a command works on: the one its DSN names, or the embedded one.

Every command of the CLI opens at most one connection, here, so a server that cannot be
reached fails the same way everywhere: one line naming the server (the DSN with its secret
masked, or the embedded server and its data directory), never showing a password.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from ..db.connect import Connection, connect
from ..dsn import check_dsn, redact, remember
from ..errors import ConfigurationError


def read_dsn_file(path: str) -> str:
    """The DSN kept in a file (a container secret): whitespace and the final newline stripped.

    A file keeps the password out of every process's command line, where `ps` and /proc show
    it to any user of the machine.
    """
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(
            f"cannot read {path}: {exc}; point it at a readable file holding the connection string"
        ) from None
    if not text:
        raise ConfigurationError(f"{path} is empty; write the connection string into it")
    return text


class Server(NamedTuple):
    """The server a command works on: its DSN, and how messages name it."""

    url: str
    name: str


@contextmanager
def located(dsn: str | None, say: Callable[[str], None]) -> Iterator[Server]:
    """The server `dsn` names once libpq can parse it (its secret kept for `scrub`, so no
    message shows it), or, when there is none, the embedded server, started for the block: the
    CLI gets here without a DSN only for `--embedded` or `demo`, and refuses otherwise.

    The embedded server is named with its data directory, and `say` tells the user whether
    this run created that directory: it lands under the working directory unless
    OUTBOX_FARM_DATA_DIR says otherwise, and must never appear there unannounced.
    """
    if dsn:
        remember(dsn)
        yield Server(check_dsn(dsn), redact(dsn))
        return
    from .embedded import data_dir, start_embedded

    path = data_dir()
    fresh = not (path / "PG_VERSION").exists()
    url, server = start_embedded(path)
    say(f"using the embedded PostgreSQL server at {path} ({'created' if fresh else 'existing'})")
    try:
        yield Server(url, f"the embedded PostgreSQL server at {path}")
    finally:
        server.cleanup()


@contextmanager
def resolve(dsn: str | None, say: Callable[[str], None]) -> Iterator[str]:
    """The DSN of the server `located` finds, for the block."""
    with located(dsn, say) as server:
        yield server.url


@contextmanager
def connected(
    dsn: str | None, say: Callable[[str], None], *, autocommit: bool = False
) -> Iterator[Connection]:
    """`connect` to the server `located` finds, for the block."""
    with (
        located(dsn, say) as server,
        connect(server.url, autocommit=autocommit, name=server.name) as conn,
    ):
        yield conn
