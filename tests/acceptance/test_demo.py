"""`outbox-farm demo`: publishes, runs a real --procs 2 farm, reports from its /metrics, stops."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg

CLI = Path(sys.executable).parent / "outbox-farm"


def test_the_demo_delivers_every_message_and_sums_up(tmp_path: Path, empty_dsn: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_FARM_")}
    done = subprocess.run(
        [str(CLI), "demo", "--dsn", empty_dsn, "--messages", "2000"],
        cwd=tmp_path,
        env={**env, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "starting outbox-farm start --procs 2" in out
    assert "handled     2,000 / 2,000" in out
    assert "done: 2,000 messages" in out
    assert "acked 1,998, retried 40, dead-lettered 2" in out  # every 50th once, every 1000th
    assert "delivery lag p50 / p99: " in out
    assert "/metrics while it ran" in out
    with psycopg.connect(empty_dsn) as demo_db:
        rows = demo_db.execute("SELECT count(*) FROM outbox_demo").fetchone()
        dead = demo_db.execute("SELECT count(*) FROM outbox_demo_dlq").fetchone()
        assert rows == (0,)
        assert dead == (2,)
    assert not list(tmp_path.glob("outbox-farm-*"))  # its working directory is gone


def test_demo_help_says_what_it_does() -> None:
    shown = subprocess.run(
        [str(CLI), "demo", "--help"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert "outbox_demo" in shown
    assert "--messages" in shown
    assert "--procs" in shown


def test_a_demo_that_cannot_reach_its_server_says_so(tmp_path: Path) -> None:
    failed = subprocess.run(
        [str(CLI), "demo", "--dsn", "host=127.0.0.1 port=1 dbname=nowhere", "--messages", "10"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert failed.returncode == 1
    assert "cannot connect to" in failed.stderr
    assert "Check --dsn" in failed.stderr
