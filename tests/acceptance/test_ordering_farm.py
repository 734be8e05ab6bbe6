"""Per-key ordering across processes: `outbox-farm start --procs 2` on rows of many keys with
random handler failures. A ledger of every handler run (both processes, one clock) shows the
runs of one key never overlap and its rows succeed in publish order."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psycopg

from outbox_farm import Farm

CLI = Path(sys.executable).parent / "outbox-farm"

ORDERAPP = '''\
"""Records every run in `ledger`; fails one run in five at random."""
import asyncio
import os
import random
import time

import psycopg

from outbox_farm import ConstantBackoff, Farm, Message

farm = Farm()
_conn = []


@farm.handler("q", concurrency=8, retry=ConstantBackoff(0.005), max_deliveries=None)
async def handle(msg: Message) -> None:
    if not _conn:
        _conn.append(
            await psycopg.AsyncConnection.connect(os.environ["ORDERAPP_DSN"], autocommit=True)
        )
    began = time.time()
    await asyncio.sleep(random.uniform(0, 0.004))
    ok = random.random() >= 0.2
    await _conn[0].execute(
        "INSERT INTO ledger VALUES (%s, %s, %s, %s, %s, %s)",
        (msg.id, msg.ordering_key, os.getpid(), began, time.time(), ok),
    )
    if not ok:
        raise RuntimeError("random failure")
'''


def test_two_processes_keep_each_keys_order_under_random_failures(
    tmp_path: Path, dsn: str, conn: psycopg.Connection[Any]
) -> None:
    conn.execute(
        "CREATE TABLE ledger (id bigint, key text, pid int, began float8, ended float8, ok bool)"
    )
    farm = Farm()
    published: dict[str | None, list[int]] = defaultdict(list)
    keys = [f"k{n}" for n in range(40)]
    for n in range(600):
        key = keys[n * 7 % len(keys)] if n % 10 else None
        row_id = farm.publish(conn, n, queue="q", ordering_key=key)
        assert row_id is not None
        published[key].append(row_id)
    conn.commit()
    (tmp_path / "orderapp.py").write_text(ORDERAPP)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_FARM_")}
    env |= {"ORDERAPP_DSN": dsn, "TMPDIR": str(tmp_path)}
    command = [str(CLI), "start", "orderapp:farm", "--procs", "2", "--dsn", dsn]
    command += ["--metrics-bind", "127.0.0.1:0", "--metrics-dir", str(tmp_path / "metrics")]
    with (tmp_path / "farm.log").open("wb") as log:
        proc = subprocess.Popen(
            command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while _count(conn, "SELECT count(*) FROM outbox") and time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "farm.log").read_text()
            time.sleep(0.2)
        assert _count(conn, "SELECT count(*) FROM outbox") == 0, "the farm did not drain"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

    runs = conn.execute("SELECT id, key, pid, began, ended, ok FROM ledger").fetchall()
    assert len({pid for _, _, pid, _, _, _ in runs}) == 2, "both processes took part"
    assert sum(1 for run in runs if not run[5]) > 50, "failures were injected"
    by_key: dict[str, list[tuple[float, float, int, bool]]] = defaultdict(list)
    succeeded: dict[str | None, list[int]] = defaultdict(list)
    for row_id, key, _, began, ended, ok in sorted(runs, key=lambda run: run[3]):
        if key is not None:
            by_key[key].append((began, ended, row_id, ok))
        if ok:
            succeeded[key].append(row_id)
    for key, key_runs in by_key.items():
        for before, after in itertools.pairwise(key_runs):
            assert after[0] >= before[1], f"{key}: row {after[2]} began while {before[2]} ran"
        assert succeeded[key] == published[key], f"{key} succeeded out of publish order"
    assert sorted(succeeded[None]) == published[None]


def _count(conn: psycopg.Connection[Any], query: str) -> int:
    row = conn.execute(query).fetchone()
    conn.commit()
    assert row is not None
    return int(row[0])
