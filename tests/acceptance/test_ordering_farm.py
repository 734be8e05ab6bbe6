"""Per-key ordering across processes: `outbox-farm start --procs 2` on rows of many keys with
random handler failures. A ledger of every handler run (both processes, one clock) shows the
runs of one key never overlap and its rows succeed in publish order."""

from __future__ import annotations

import itertools
from collections import defaultdict
from pathlib import Path
from typing import Any

import psycopg

from outbox_farm import Farm
from tests.acceptance.drained_farm import drain_with_farm

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
    await asyncio.sleep(random.uniform(0, 0.004))  # a random run time: overlaps would show
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
    drain_with_farm(tmp_path, "orderapp", ORDERAPP, conn, dsn, env={"ORDERAPP_DSN": dsn})

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
