"""The Postgres server a command works on: the one its DSN names, or the embedded one.

Every command of the CLI opens at most one connection, here, so a server that cannot be
reached fails the same way everywhere: one line, with the DSN's password redacted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .db.connect import Connection, connect
from .dsn import check_dsn
from .errors import ConfigurationError


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


@contextmanager
def resolve(dsn: str | None, say: Callable[[str], None]) -> Iterator[str]:
    """The DSN to use: `dsn` once libpq can parse it, or, when there is none, the embedded
    server's, started for the block (and `say` tells the user so)."""
    if dsn:
        yield check_dsn(dsn)
        return
    from .embedded import start_embedded

    url, server = start_embedded()
    say(f"no --dsn given: using the embedded Postgres at {url}")
    try:
        yield url
    finally:
        server.cleanup()


@contextmanager
def connected(
    dsn: str | None, say: Callable[[str], None], *, autocommit: bool = False
) -> Iterator[Connection]:
    """`connect` to the server `resolve` finds, for the block."""
    with resolve(dsn, say) as url, connect(url, autocommit=autocommit) as conn:
        yield conn
