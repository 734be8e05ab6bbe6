"""`outbox-farm queue pause|resume` against a real farm of two processes (issue 47, item 1).

The app has a slow queue ("slow": each handler sleeps) and a quick one ("other"); each handler
records when its row was claimed (the database's clock), when it started (this machine's) and
when it finished (the database's). A pause must stop every claim of the slow queue within a
second of the command's change, in both processes, while the handlers already running finish
(and the rows a claim under way took, which may start a wave of handlers later: the promise is
on claims, not starts); a resume lets rows flow again; a pause
`--for 2s` ends by itself; a farm started while the queue is paused claims nothing of it (its
other queue, handled, is the positive control) and shows the pause in /healthz (a note, 200,
not a stall) and in the gauge. Every wait is a deadline-bounded poll on a condition.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.acceptance.test_cli import run
from tests.acceptance.test_farm import farm_process, scalar
from tests.steps import publish, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.one_server]

Conn = psycopg.Connection[Any]
BOUND = timedelta(seconds=1)  # the promise: every farm stops claiming within a second
SLEEP = 1.0  # seconds each "slow" handler runs
CONCURRENCY = 3  # per process

PAUSEAPP = '''\
"""Two queues; every handler records its claim, its start and its end in `starts`."""
import asyncio
import os
import time

import psycopg

from outbox_farm import Farm, Message

farm = Farm(table="outbox", dlq_table="outbox_dlq")
_box = []  # this worker's connection, made after the fork


async def _record(msg, started):
    if not _box:
        _box.append(
            await psycopg.AsyncConnection.connect(os.environ["FARMAPP_DSN"], autocommit=True)
        )
    await _box[0].execute(
        "INSERT INTO starts (id, queue, pid, claimed_at, started_at, finished_at) "
        "VALUES (%s, %s, %s, %s, to_timestamp(%s), clock_timestamp())",
        (msg.id, msg.queue, os.getpid(), msg.claimed_at, started),
    )


@farm.handler("slow", concurrency=int(os.environ["PAUSEAPP_CONCURRENCY"]))
async def slow(msg: Message) -> None:
    started = time.time()
    await asyncio.sleep(float(os.environ["PAUSEAPP_SLEEP"]))
    await _record(msg, started)


@farm.handler("other")
async def other(msg: Message) -> None:
    await _record(msg, time.time())
'''


@pytest.fixture
def pause_app(tmp_path: Path, conn: Conn) -> Path:
    (tmp_path / "pauseapp.py").write_text(PAUSEAPP)
    conn.execute(
        "CREATE TABLE starts (id bigint, queue text, pid int, claimed_at timestamptz, "
        "started_at timestamptz, finished_at timestamptz)"
    )
    return tmp_path


def farm_of(app: Path, dsn: str) -> Any:
    return farm_process(
        app,
        dsn,
        app="pauseapp:farm",
        procs=2,
        PAUSEAPP_SLEEP=str(SLEEP),
        PAUSEAPP_CONCURRENCY=str(CONCURRENCY),
    )


def queue(dsn: str, *args: str) -> None:
    done = run("queue", *args, "--dsn", dsn)
    assert done.returncode == 0, done.stdout + done.stderr


def changed_at(conn: Conn, name: str) -> datetime:
    """When the last change of `name`'s controls was made: its transaction's start, a hair
    before its commit, so a bound measured from it is, if anything, strict."""
    found = scalar(conn, "SELECT changed_at FROM outbox_farm_queues WHERE queue = %s", [name])
    assert isinstance(found, datetime)
    return found


def starts(conn: Conn, name: str) -> list[tuple[datetime, int]]:
    """(start, pid) of each finished handler of queue `name`, in start order."""
    rows = conn.execute(
        "SELECT started_at, pid FROM starts WHERE queue = %s ORDER BY started_at", [name]
    ).fetchall()
    return [(row[0], row[1]) for row in rows]


def claims(conn: Conn, name: str) -> list[datetime]:
    """When each handled row of queue `name` was claimed (its claim's now()), in order."""
    rows = conn.execute(
        "SELECT claimed_at FROM starts WHERE queue = %s ORDER BY claimed_at", [name]
    ).fetchall()
    return [row[0] for row in rows]


def settled(conn: Conn, name: str, published: int) -> bool:
    """Nothing of the queue is leased, and every row is either still waiting or was handled
    and acked (in one snapshot): every handler that started has finished and its outcome is
    written, and no process holds a row it has not run."""
    row = conn.execute(
        "SELECT (SELECT count(*) FROM outbox WHERE queue = %(q)s AND acquired_token IS NOT NULL),"
        " (SELECT count(*) FROM outbox WHERE queue = %(q)s)"
        " + (SELECT count(*) FROM starts WHERE queue = %(q)s)",
        {"q": name},
    ).fetchone()
    return row == (0, published)


def leased_ids(conn: Conn, name: str) -> set[int]:
    rows = conn.execute(
        "SELECT id FROM outbox WHERE queue = %s AND acquired_token IS NOT NULL", [name]
    ).fetchall()
    return {int(row[0]) for row in rows}


def handled_ids(conn: Conn, name: str) -> set[int]:
    rows = conn.execute("SELECT id FROM starts WHERE queue = %s", [name]).fetchall()
    return {int(row[0]) for row in rows}


def test_a_pause_stops_every_process_within_a_second_and_a_resume_or_its_end_restarts(
    pause_app: Path, dsn: str, conn: Conn
) -> None:
    with farm_of(pause_app, dsn) as farm:
        wait_for(lambda: farm.healthy(2), "a healthy farm of two processes", 60, farm)
        publish(conn, 400, queue="slow")
        # Both processes busy with the slow queue: the pause has something to stop in each.
        wait_for(
            lambda: len({pid for _, pid in starts(conn, "slow")}) == 2,
            "both processes running slow handlers",
            60,
            farm,
        )
        running = leased_ids(conn, "slow")
        assert running

        queue(dsn, "pause", "slow", "--reason", "test")
        paused_at = changed_at(conn, "slow")
        wait_for(
            lambda: farm.metric("outbox_farm_queue_paused", queue="slow") == 1,
            "outbox_farm_queue_paused{queue=slow} 1",
            30,
            farm,
        )
        wait_for(lambda: settled(conn, "slow", 400), "the running handlers finished", 60, farm)
        before = starts(conn, "slow")
        last = claims(conn, "slow")[-1]
        assert last - paused_at < BOUND, f"a row was claimed {last - paused_at} after the pause"
        # The handlers running when the pause came finished (and were acked), not abandoned.
        assert running <= handled_ids(conn, "slow")
        waiting = int(scalar(conn, "SELECT count(*) FROM outbox WHERE queue = 'slow'"))
        assert waiting > 0  # rows are waiting: the pause, not an empty queue, stopped them

        queue(dsn, "resume", "slow")
        resumed_at = changed_at(conn, "slow")
        wait_for(
            lambda: len(starts(conn, "slow")) > len(before),
            "rows flowing after the resume",
            30,
            farm,
        )
        assert all(at < paused_at + BOUND or at >= resumed_at for at in claims(conn, "slow"))

        queue(dsn, "pause", "slow", "--for", "2s")
        short_at = changed_at(conn, "slow")
        until = scalar(conn, "SELECT paused_until FROM outbox_farm_queues WHERE queue = 'slow'")
        assert until - short_at == timedelta(seconds=2)
        # It ends by itself: rows start again after its end, with no resume.
        wait_for(
            lambda: any(at >= until for at in claims(conn, "slow")),
            "rows flowing after the pause's end",
            30,
            farm,
        )
        gap = [at for at in claims(conn, "slow") if short_at + BOUND <= at < until]
        assert gap == [], "rows claimed while the pause for 2s was in force"
        code, _ = farm.stop()
    assert code == 0, farm.log_tail()


def test_a_farm_started_while_its_queue_is_paused_claims_nothing_of_it(
    pause_app: Path, dsn: str, conn: Conn
) -> None:
    queue(dsn, "pause", "slow", "--reason", "held for the test")
    waiting = publish(conn, 5, queue="slow")
    with farm_of(pause_app, dsn) as farm:
        wait_for(lambda: farm.healthy(2), "a healthy farm of two processes", 60, farm)
        # The positive control: the farm claims and runs its other queue.
        publish(conn, 3, queue="other")
        wait_for(lambda: len(starts(conn, "other")) == 3, "the other queue handled", 60, farm)
        wait_for(
            lambda: farm.metric("outbox_farm_queue_paused", queue="slow") == 1,
            "outbox_farm_queue_paused{queue=slow} 1",
            30,
            farm,
        )
        deliveries = conn.execute(
            "SELECT sum(deliveries_count), count(*) FROM outbox WHERE queue = 'slow'"
        ).fetchone()
        assert deliveries == (0, len(waiting))
        assert starts(conn, "slow") == []

        status, health = farm.health() or (None, {})
        assert status == 200, health
        notes = health.get("degraded", [])
        assert any(n.startswith("queue slow paused") and "held for the test" in n for n in notes)
        assert not any("stall" in str(p) for p in health.get("problems", []))

        queue(dsn, "resume", "slow")
        wait_for(lambda: len(starts(conn, "slow")) == len(waiting), "the paused rows run", 60, farm)
        wait_for(
            lambda: farm.metric("outbox_farm_queue_paused", queue="slow") == 0,
            "outbox_farm_queue_paused{queue=slow} 0",
            30,
            farm,
        )
        code, _ = farm.stop()
    assert code == 0, farm.log_tail()
