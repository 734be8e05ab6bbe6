"""`outbox-farm demo`: publishes, runs a real --procs 2 farm, reports from its /metrics, stops."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

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
    # The metrics: where the demo farm served them, and where `start` serves them (not there).
    assert re.search(r"served its metrics at http://127\.0\.0\.1:\d+/metrics \(a free port\)", out)
    assert "`outbox-farm start` serves /metrics and /healthz on 127.0.0.1:9464" in out
    # The dlq list it suggests reaches the demo's database (the --dsn it was given), as printed.
    suggested, listed = _run_suggested_list(out, tmp_path, env)
    assert "--dsn" in suggested
    assert len(json.loads(listed.stdout)) == 2
    assert "embedded" not in listed.stderr
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


@pytest.mark.slow
def test_the_demo_on_the_embedded_server_suggests_a_dlq_list_that_reaches_it(
    tmp_path: Path,
) -> None:
    """The demo alone runs on the embedded server unasked; the command it suggests must ask for
    it (`--embedded`), since `dlq list` without a DSN refuses to start it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_FARM_")}
    done = subprocess.run(
        [str(CLI), "demo", "--messages", "1000", "--procs", "1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    data = tmp_path / ".outbox-farm" / "pgdata"
    assert f"using the embedded PostgreSQL server at {data} (created)" in done.stderr
    suggested, listed = _run_suggested_list(done.stdout, tmp_path, env)
    assert "--embedded" in shlex.split(suggested)
    assert len(json.loads(listed.stdout)) == 1  # message 7 of the thousand
    unasked = subprocess.run(
        [str(CLI), "dlq", "list", "--dlq-table", "outbox_demo_dlq"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert unasked.returncode == 2, unasked.stdout + unasked.stderr
    assert "no database given" in unasked.stderr


def _run_suggested_list(
    out: str, cwd: Path, env: dict[str, str]
) -> tuple[str, subprocess.CompletedProcess[str]]:
    """The `dlq list` command the demo's summary suggests, run as printed (with --json): the
    suggestion and its successful result."""
    (suggested,) = re.findall(r"see them with `(outbox-farm dlq list [^`]*)`", out)
    listed = subprocess.run(
        [str(CLI), *shlex.split(suggested)[1:], "--json"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert listed.returncode == 0, listed.stderr
    return suggested, listed
