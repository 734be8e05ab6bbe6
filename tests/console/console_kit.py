"""What the console's tests share: an app on a test database, DLQ rows made to measure, and
`outbox-farm console` as a subprocess."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from starlette.testclient import TestClient

from outbox_farm.console import ConsoleSettings, create_app
from outbox_farm.console.database import Database
from outbox_farm.console.security import Tokens
from outbox_farm.names import TableNames
from tests.acceptance.test_cli import CLI
from tests.acceptance.test_farm import clean_env, free_port
from tests.steps import wait_for
from tests.tools import missing_tool

Conn = psycopg.Connection[Any]
NAMES = TableNames.build("outbox", "outbox_dlq")
BASE = "http://127.0.0.1:9465"  # the Host a loopback console accepts
TOKEN = "s3cret-token-of-alice-0123456789"
EXCEPTION = (
    "KeyError('sku')\nTraceback (innermost frames last):\n"
    '  File "/srv/app/orders.py", line 41, in handle\n    price = PRICES[order.sku]'
)


def fail(
    conn: Conn,
    n: int,
    queue: str = "orders",
    reason: str = "retry_terminal",
    *,
    payload: str | None = None,
    headers: str = '{"content-type": "application/json", "correlation_id": "corr-1"}',
    exception: str = EXCEPTION,
    age: str = "0 s",
) -> list[int]:
    """`n` DLQ rows as the farm writes them; their ids, oldest first."""
    rows = conn.execute(
        "INSERT INTO outbox_dlq (original_id, queue, payload, headers, deliveries_count, "
        "created_at, failed_at, failure_reason, last_exception) "
        "SELECT g, %(queue)s, coalesce(convert_to(%(payload)s, 'UTF8'), "
        "convert_to('{\"n\": ' || g || '}', 'UTF8')), %(headers)s::jsonb, 3, now(), "
        "now() - %(age)s::interval, %(reason)s, %(exc)s "
        "FROM generate_series(1, %(n)s) AS g ORDER BY g RETURNING id",
        {
            "queue": queue,
            "payload": payload,
            "headers": headers,
            "age": age,
            "n": n,
            "reason": reason,
            "exc": exception,
        },
    ).fetchall()
    return [int(r[0]) for r in rows]


def dlq_ids(conn: Conn) -> set[int]:
    return {int(r[0]) for r in conn.execute("SELECT id FROM outbox_dlq").fetchall()}


def settings(dsn: str, **given: Any) -> ConsoleSettings:
    return ConsoleSettings(database=Database(dsn, "the test database"), names=NAMES, **given)


@contextlib.contextmanager
def client(dsn: str, **given: Any) -> Iterator[TestClient]:
    """The console app on `dsn`, as a loopback browser reaches it (no metrics unless given)."""
    with TestClient(create_app(settings(dsn, **given)), base_url=BASE) as test_client:
        yield test_client


def tokens(**by_name: str) -> Tokens:
    return Tokens(by_name or {"alice": TOKEN})


def csrf_of(html: str) -> str:
    marker = 'name="csrf" value="'
    start = html.index(marker) + len(marker)
    return html[start : html.index('"', start)]


CHROMIUM = "/usr/bin/chromium"


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """Debian's Chromium driven by Playwright, for the block; the test is skipped (failed in
    CI) when either is missing."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing_tool("Playwright is not installed: pip install playwright")
    if not os.access(CHROMIUM, os.X_OK):
        missing_tool(f"no Chromium at {CHROMIUM}: apt-get install chromium")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield launched
        launched.close()


class RunningConsole:
    """One `outbox-farm console` subprocess."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc, self.url, self.log_path = proc, url, log

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self) -> str:
        return self.log()


@contextlib.contextmanager
def console_process(
    tmp_path: Path,
    dsn: str,
    *args: str,
    name: str = "console",
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[RunningConsole]:
    """`outbox-farm console` on a free loopback port, answering before this returns; run from
    `cwd` (where an app it is given lives), with `env` added to a clean environment."""
    import urllib.request

    port = free_port()
    log_path = tmp_path / f"{name}.log"
    command = [CLI, "console", "--dsn", dsn, "--bind", f"127.0.0.1:{port}", *args]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=clean_env(**(env or {})),
            cwd=cwd,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    running = RunningConsole(proc, url, log_path)

    def answers() -> bool:
        try:
            with urllib.request.urlopen(url + "/static/console.css", timeout=5):
                return True
        except OSError:
            return False

    try:
        wait_for(answers, "the console to answer", 60, running)
        yield running
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)
