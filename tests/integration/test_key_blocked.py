"""The `key_blocked` mark (migration 0008) against a real Postgres: a keyed row with a whole
window of older rows of its key before it leaves the pending index, each deletion of a row of
the key brings the first marked one back, and a row left marked at the head of its key (its
publish committed after the rows before it were deleted; an operator deleted rows by hand) is
freed by the fetchers, never left waiting. The mark never decides order: the claim's own check
does."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from outbox_farm import DeadLetter, Farm, Message
from outbox_farm.admin import queue_stats
from outbox_farm.db.pool import open_pool
from outbox_farm.db.store import PostgresStore
from outbox_farm.names import TableNames
from outbox_farm.ops.migrate import migrate
from outbox_farm.ops.schema_check import check_schema
from outbox_farm.queries import KEY_WINDOW, Queries
from outbox_farm.settings import RuntimeSettings
from tests.steps import run_until

Conn = psycopg.Connection[Any]
SETTINGS = RuntimeSettings(poll_interval=0.05, graceful_timeout=0.5)  # a held row: cut short
NAMES = TableNames.build("outbox", "outbox_dlq")
DEEP = KEY_WINDOW + 3  # rows of one key: the last three are marked


def marked(conn: Conn, table: str = "outbox") -> list[tuple[str | None, bool]]:
    """(ordering_key, key_blocked) of every row, in id order."""
    rows = conn.execute(f"SELECT ordering_key, key_blocked FROM {table} ORDER BY id").fetchall()
    return [(key, blocked) for key, blocked in rows]


def line(key: str, rows: int) -> list[tuple[str | None, bool]]:
    """How `rows` rows of one key are marked: all but the window's first."""
    return [(key, n >= KEY_WINDOW) for n in range(rows)]


def free_stranded(dsn: str, queue: str) -> int:
    async def run() -> int:
        pool = await open_pool(dsn, 1)
        try:
            return await PostgresStore(pool, Queries(NAMES)).free_stranded(queue)
        finally:
            await pool.close()

    return asyncio.run(run())


def test_publish_marks_the_rows_past_the_window_of_their_key(conn: Conn) -> None:
    farm = Farm()
    for n in range(DEEP):
        farm.publish(conn, {"n": n}, queue="q", ordering_key="a")
    farm.publish(conn, {"n": 0}, queue="q")  # no key: never marked
    farm.publish(conn, {"n": 0}, queue="other", ordering_key="a")  # another queue's line
    # A batch counts the rows already waiting and its own rows of the key before each.
    keys = ["a", "b"] * (KEY_WINDOW + 1)
    farm.publish_batch(conn, list(range(len(keys))), queue="q", ordering_keys=keys)
    rows = marked(conn)
    assert rows[:DEEP] == line("a", DEEP)
    assert rows[DEEP : DEEP + 2] == [(None, False), ("a", False)]
    batch = rows[DEEP + 2 :]
    assert [b for k, b in batch if k == "a"] == [True] * (KEY_WINDOW + 1)
    assert [b for k, b in batch if k == "b"] == [False] * KEY_WINDOW + [True]


def test_timers_are_marked_like_any_row(conn: Conn) -> None:
    farm = Farm()
    for n in range(KEY_WINDOW + 1):
        farm.publish(conn, n, queue="q", ordering_key="k", timer_id=f"t{n}")
    farm.publish(conn, 99, queue="q", ordering_key="k", timer_id="t0", on_timer_conflict="extend")
    assert marked(conn) == line("k", KEY_WINDOW + 1)


def test_each_deletion_brings_the_first_marked_row_of_its_key_into_the_window(
    dsn: str,
) -> None:
    """The farm's deletions (ack, dead-letter move) move the line up by one each."""
    farm = Farm(dlq_table="outbox_dlq")
    ran: list[int] = []

    @farm.handler("q", concurrency=1)
    async def handle(msg: Message) -> None:
        ran.append(msg.id)
        if len(ran) == 2:
            raise DeadLetter("second row: dead-lettered, not acked")

    with psycopg.connect(dsn, autocommit=True) as conn:
        ids = farm.publish_batch(conn, list(range(DEEP)), queue="q", ordering_keys=["k"] * DEEP)
        run_until(farm, dsn, lambda: len(ran) == DEEP, "the key drained", SETTINGS, 60)
        assert ran == ids
        assert marked(conn) == []
        assert conn.execute("SELECT count(*) FROM outbox_dlq").fetchone() == (1,)


def test_an_ack_moves_the_line_up_by_exactly_one(dsn: str) -> None:
    """Stopped while the second row runs: the head's ack unmarked one row, no more."""
    farm = Farm()
    ran: list[int] = []

    @farm.handler("q", concurrency=1)
    async def handle(msg: Message) -> None:
        ran.append(msg.id)
        if len(ran) == 2:
            await asyncio.Event().wait()  # holds the second row until the stop releases it

    with psycopg.connect(dsn, autocommit=True) as conn:
        farm.publish_batch(conn, list(range(DEEP)), queue="q", ordering_keys=["k"] * DEEP)
        run_until(farm, dsn, lambda: len(ran) == 2, "the second row run", SETTINGS, 60)
        assert marked(conn) == line("k", DEEP - 1)


def test_a_row_left_marked_at_the_head_of_its_key_is_freed_and_run(dsn: str) -> None:
    """A publish whose transaction stays open while every row before it is deleted: its mark
    counted rows that are gone by the time it commits, and no deletion could see it to
    unmark it. The fetchers find it and the farm runs it."""
    farm = Farm()
    ran: list[int] = []

    @farm.handler("q", concurrency=4)
    async def handle(msg: Message) -> None:
        ran.append(msg.id)

    with psycopg.connect(dsn, autocommit=True) as setup:
        before = farm.publish_batch(
            setup, list(range(KEY_WINDOW)), queue="q", ordering_keys=["k"] * KEY_WINDOW
        )
    with psycopg.connect(dsn) as producer:
        late = farm.publish(producer, "late", queue="q", ordering_key="k")
        with psycopg.connect(dsn, autocommit=True) as deleter:
            deleter.execute("DELETE FROM outbox WHERE id = ANY(%s)", (before,))
        producer.commit()
        assert marked(producer) == [("k", True)]
        producer.commit()
    run_until(farm, dsn, lambda: late in ran, "the stranded row run", SETTINGS, 60)
    assert ran == [late]


def test_free_stranded_frees_only_rows_with_nothing_before_them(dsn: str) -> None:
    farm = Farm()
    with psycopg.connect(dsn, autocommit=True) as conn:
        a = farm.publish_batch(conn, list(range(DEEP)), queue="q", ordering_keys=["a"] * DEEP)
        b = farm.publish_batch(conn, list(range(DEEP)), queue="q", ordering_keys=["b"] * DEEP)
        c = farm.publish_batch(conn, list(range(DEEP)), queue="other", ordering_keys=["c"] * DEEP)
        # Operators delete every row of a's and c's windows by hand; b keeps its head.
        conn.execute("DELETE FROM outbox WHERE id = ANY(%s)", (a[:KEY_WINDOW] + c[:KEY_WINDOW],))
        conn.execute("DELETE FROM outbox WHERE id = ANY(%s)", (b[1:KEY_WINDOW],))
        conn.execute("LISTEN outbox_outbox")
        assert free_stranded(dsn, "q") == 1  # a's first marked row, now its head
        rows = conn.execute(
            "SELECT id, key_blocked FROM outbox WHERE queue = 'q' ORDER BY id"
        ).fetchall()
        assert rows == [
            (a[KEY_WINDOW], False),
            *[(i, True) for i in a[KEY_WINDOW + 1 :]],
            (b[0], False),
            *[(i, True) for i in b[KEY_WINDOW:]],  # behind b's head: waiting, not stranded
        ]
        assert [n.payload for n in conn.notifies(timeout=5, stop_after=1)] == ["q"]
        assert free_stranded(dsn, "q") == 0
        # Another queue's rows are its own fetchers' business.
        other = conn.execute("SELECT key_blocked FROM outbox WHERE queue = 'other'").fetchall()
        assert other == [(True,)] * (DEEP - KEY_WINDOW)


def test_a_writer_cannot_mark_a_row_without_a_key(conn: Conn) -> None:
    """No deletion or look for stranded rows ever unmarks an unkeyed row: it may not be
    marked at all."""
    with pytest.raises(psycopg.errors.CheckViolation, match="outbox_blocked_ck"):
        conn.execute("INSERT INTO outbox (queue, payload, key_blocked) VALUES ('q', 'y', true)")
    Farm().publish_batch(conn, list(range(DEEP)), queue="q", ordering_keys=["k"] * DEEP)
    with pytest.raises(psycopg.errors.CheckViolation, match="outbox_blocked_ck"):
        conn.execute("UPDATE outbox SET ordering_key = NULL WHERE key_blocked")


def test_a_hot_key_backlog_is_not_in_the_pending_index(conn: Conn) -> None:
    """With the head of a deep key running, the next-due query reads the window's rows only,
    not the whole backlog: the pending index holds the window."""
    farm = Farm()
    farm.publish_batch(conn, list(range(500)), queue="q", ordering_keys=["hot"] * 500)
    conn.execute(
        "UPDATE outbox SET acquired_token = gen_random_uuid(), acquired_at = now()"
        " WHERE id = (SELECT min(id) FROM outbox)"
    )
    conn.execute("SET enable_seqscan = off")  # 500 rows: a scan would be cheaper
    plan = conn.execute(
        "EXPLAIN (ANALYZE, COSTS OFF, FORMAT JSON) SELECT c.id FROM outbox AS c"
        " WHERE c.queue = 'q' AND c.acquired_token IS NULL AND NOT c.key_blocked"
    ).fetchone()
    assert plan is not None
    top = plan[0][0]["Plan"]
    assert "outbox_pending_idx" in str(top)
    assert top["Actual Rows"] == KEY_WINDOW - 1


def test_stats_count_the_rows_waiting_in_a_key_s_line(conn: Conn) -> None:
    Farm().publish_batch(conn, list(range(DEEP)), queue="q", ordering_keys=["k"] * DEEP)
    (q,) = queue_stats(conn, NAMES)
    assert q.counts["ready"].value == KEY_WINDOW
    assert q.counts["waiting"].value == DEEP - KEY_WINDOW


def test_the_mark_works_for_a_schema_qualified_table(empty_dsn: str) -> None:
    names = TableNames.build("app.jobs", None)
    farm = Farm(table="app.jobs")
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA app")
        migrate(conn, names)
        farm.publish_batch(conn, list(range(DEEP)), queue="q", ordering_keys=["k"] * DEEP)
        assert marked(conn, "app.jobs") == line("k", DEEP)
        assert check_schema(conn, names) == []
