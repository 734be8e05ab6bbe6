"""`outbox-farm start APP --procs N` in a folder of the test's own, run until the outbox is
empty, then stopped with SIGTERM: the farm subprocess the ordering tests share."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg

from tests.steps import wait_for

CLI = Path(sys.executable).parent / "outbox-farm"


def drain_with_farm(
    folder: Path,
    app: str,
    source: str,
    conn: psycopg.Connection[Any],
    dsn: str,
    *,
    procs: int = 2,
    env: dict[str, str] | None = None,
    timeout: float = 90,
) -> None:
    """Write `source` as `<app>.py` in `folder`, start `<app>:farm` there on `dsn` (none of
    the caller's OUTBOX_FARM_* settings, plus `env`), wait until `conn` sees an empty outbox,
    and stop it: it must exit 0. The farm is killed whatever happens."""
    (folder / f"{app}.py").write_text(source)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_FARM_")}
    environ |= {"TMPDIR": str(folder), **(env or {})}
    command = [str(CLI), "start", f"{app}:farm", "--procs", str(procs), "--dsn", dsn]
    command += ["--metrics-bind", "127.0.0.1:0", "--metrics-dir", str(folder / "metrics")]
    log_path = folder / "farm.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command, cwd=folder, stdout=log, stderr=subprocess.STDOUT, env=environ,
            start_new_session=True,
        )  # fmt: skip

    def drained() -> bool:
        assert proc.poll() is None, log_path.read_text()
        return _outbox_rows(conn) == 0

    try:
        wait_for(drained, "the farm to drain the outbox", timeout, every=0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _outbox_rows(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM outbox").fetchone()
    conn.commit()
    assert row is not None
    return int(row[0])
