"""The storage layer on its own, against a real Postgres: typed rows, matched (id, token) pairs,
unconfirmed resends, and driver errors arriving as outbox_farm errors."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any, TypeVar

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool

from outbox_farm import storage
from outbox_farm.db import housekeeping, outcomes
from outbox_farm.db.listen import listen
from outbox_farm.db.pool import Pool
from outbox_farm.db.store import PostgresStore
from outbox_farm.errors import (
    ConnectionLost,
    DatabaseError,
    PermanentError,
    PrivilegeError,
    SchemaError,
)
from outbox_farm.message import Message
from outbox_farm.names import TableNames
from outbox_farm.queries import Queries

QUERIES = Queries(TableNames.build("outbox", "outbox_dlq"))
T = TypeVar("T")


@asynccontextmanager
async def pool_for(dsn: str, **options: Any) -> AsyncIterator[Pool]:
    options.setdefault("min_size", 1)
    options.setdefault("max_size", 2)
    async with AsyncConnectionPool(dsn, kwargs={"autocommit": True}, open=False, **options) as pool:
        yield pool


def run(dsn: str, scenario: Callable[[Pool], Awaitable[T]], **options: Any) -> T:
    """`scenario(pool)` on a pool of its own, on a fresh event loop."""

    async def main() -> T:
        async with pool_for(dsn, **options) as pool:
            return await scenario(pool)

    return asyncio.run(main())


def insert(
    conn: psycopg.Connection[Any],
    queue: str,
    n: int,
    token: uuid.UUID | None = None,
    due: str = "0 s",
) -> list[int]:
    """n rows of `queue` (held under `token` for a minute when one is given)."""
    rows = conn.execute(
        "INSERT INTO outbox (queue, payload, headers, next_attempt_at, acquired_token, "
        "acquired_at, lease_expires_at) "
        "SELECT %s, convert_to('body-' || g, 'UTF8'), jsonb_build_object('n', g), "
        "now() + %s::interval, %s, CASE WHEN %s::uuid IS NOT NULL THEN now() END, "
        "CASE WHEN %s::uuid IS NOT NULL THEN now() + interval '1 minute' END "
        "FROM generate_series(1, %s) AS g ORDER BY g RETURNING id",
        [queue, due, token, token, token, n],
    ).fetchall()
    return [row[0] for row in rows]


async def claim(
    pool: Pool, queue: str = "q", limit: int = 10, queries: Queries = QUERIES, **overrides: Any
) -> list[Message]:
    fields: dict[str, Any] = {"lease_ttl": 60.0, "token": uuid.uuid4(), "sent": 0.0}
    fields |= {"start_by": 60.0, "held": []} | overrides
    return await PostgresStore(pool, queries).claim(storage.Claim(queue, limit, **fields))


# -- claims --------------------------------------------------------------------------------


def test_claim_returns_typed_rows_under_the_new_lease(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """An expired lease is taken before due rows; a row this runner still holds never is."""
    ids = insert(conn, "q", 2)
    held = uuid.uuid4()  # the token of a claim this runner still has rows of
    (mine,) = insert(conn, "q", 1, held)
    (theirs,) = insert(conn, "q", 1, uuid.uuid4())
    conn.execute(
        "UPDATE outbox SET lease_expires_at = now() - interval '1 s' WHERE id >= %s", [mine]
    )
    insert(conn, "other", 2)
    insert(conn, "q", 1, due="1 hour")
    token = uuid.uuid4()

    async def scenario(pool: Pool) -> tuple[list[Message], list[Message]]:
        return await claim(pool, limit=1, held=[held]), await claim(pool, token=token, held=[held])

    expired, rows = run(dsn, scenario)
    assert [msg.id for msg in expired] == [theirs]
    assert sorted(msg.id for msg in rows) == ids
    first = min(rows, key=lambda msg: msg.id)
    assert first.body == b"body-1"
    assert first.headers == {"n": 1}
    assert (first.deliveries_count, first.attempts_count) == (1, 0)
    assert isinstance(first.created_at, datetime)
    assert first.first_attempt_at is None
    assert first.timer_id is None
    assert {msg.claimed_at for msg in rows} == {first.claimed_at}  # one now()
    assert {msg.lease_token for msg in rows} == {token}
    leased = conn.execute(
        "SELECT id FROM outbox WHERE acquired_token = %s ORDER BY id", [token]
    ).fetchall()
    assert [row[0] for row in leased] == ids


def test_claim_reads_columns_by_name_whatever_order_the_statement_returns(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """runtime.sql returning its columns in another order changes nothing."""

    class Reordered(Queries):
        def __getitem__(self, name: str) -> str:
            text = super().__getitem__(name)
            if name != "claim":
                return text
            head, _, _ = text.rpartition("RETURNING")
            return head + (
                "RETURNING NULL::text AS unloadable, o.ordering_key, o.acquired_at, o.timer_id, "
                "o.first_attempt_at, "
                "o.next_attempt_at, o.created_at, o.attempts_count, o.deliveries_count, "
                "o.headers::text AS headers, o.payload, o.id"
            )

    ids = insert(conn, "q", 2)
    queries = Reordered(QUERIES.names)

    rows = run(dsn, lambda pool: claim(pool, limit=5, queries=queries))
    assert [(msg.id, msg.body, msg.deliveries_count) for msg in rows] == [
        (ids[0], b"body-1", 1),
        (ids[1], b"body-2", 1),
    ]
    assert isinstance(rows[0].claimed_at, datetime)


def test_a_claim_waits_for_its_wal_flush_only_when_it_takes_a_keyed_row(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A claim of rows without an ordering key commits without waiting for the WAL flush (lost
    in a server crash, it only means a delivery again); one that takes a keyed row waits, since
    a keyed row claimed twice would run beside itself. A trigger notes the setting in force
    when the claim's UPDATE writes each row; the session's own setting is left as it was."""
    conn.execute("CREATE TABLE commit_modes (id bigint, mode text)")
    conn.execute(
        "CREATE FUNCTION note_commit_mode() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "INSERT INTO commit_modes VALUES (NEW.id, current_setting('synchronous_commit')); "
        "RETURN NULL; END $$"
    )
    conn.execute(
        "CREATE TRIGGER note_commit_mode AFTER UPDATE ON outbox "
        "FOR EACH ROW EXECUTE FUNCTION note_commit_mode()"
    )
    plain = insert(conn, "q", 2)
    mixed = insert(conn, "k", 2)
    conn.execute("UPDATE outbox SET ordering_key = 'key' WHERE id = %s", [mixed[1]])
    conn.execute("DELETE FROM commit_modes")

    async def scenario(pool: Pool) -> tuple[int, int, str]:
        first = await claim(pool, "q")
        second = await claim(pool, "k")
        async with pool.connection() as session:
            shown = await (await session.execute("SHOW synchronous_commit")).fetchone()
        assert shown is not None
        return len(first), len(second), shown[0]

    assert run(dsn, scenario, max_size=1) == (2, 2, "on")
    modes = dict(conn.execute("SELECT id, mode FROM commit_modes").fetchall())
    assert modes == {plain[0]: "off", plain[1]: "off", mixed[0]: "on", mixed[1]: "on"}


def test_next_due_is_seconds_on_the_database_clock_or_none(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    assert run(dsn, lambda pool: PostgresStore(pool, QUERIES).next_due("q")) is None
    insert(conn, "q", 1, due="30 s")
    due = run(dsn, lambda pool: PostgresStore(pool, QUERIES).next_due("q"))
    assert due is not None
    assert 25 < due <= 30
    insert(conn, "q", 1, due="-5 s")
    due = run(dsn, lambda pool: PostgresStore(pool, QUERIES).next_due("q"))
    assert due is not None
    assert due < 0


# -- outcome writes ------------------------------------------------------------------------


async def send_all(pool: Pool, *batch: storage.Write) -> list[storage.Written]:
    async with PostgresStore(pool, QUERIES).flush() as flush:
        return [await flush.send(write) for write in batch]


def test_writes_return_the_rows_they_matched_and_ignore_other_tokens(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    token, other = uuid.uuid4(), uuid.uuid4()
    acked, retried, released, moved = (insert(conn, kind, 2, token) for kind in "arld")
    wrong = [token, other]  # the second row of each write names a lease nobody holds
    batch = [
        storage.ack(acked, wrong),
        storage.retry(retried, wrong, delays=[5.0, 5.0], ran=[True, True], started=[None, None]),
        storage.release(released, wrong),
        storage.dead_letter(moved, wrong, reasons=["rejected"] * 2, exceptions=["boom", None]),
    ]
    results = run(dsn, lambda pool: send_all(pool, *batch))
    assert len(results) == 4
    for written in results:
        assert written.matched == {0}  # the first row of the write
        assert (written.unconfirmed, written.refused) == (set(), {})

    state = dict(
        conn.execute(
            "SELECT id, (acquired_token, deliveries_count, attempts_count, "
            "next_attempt_at > now())::text FROM outbox"
        ).fetchall()
    )
    assert acked[0] not in state
    assert moved[0] not in state
    assert state[retried[0]] == "(,0,1,t)"  # lease freed, an attempt counted, due later
    assert state[released[0]] == "(,0,0,f)"  # lease freed, the claim's delivery taken back
    for ids in (acked, retried, released, moved):
        assert state[ids[1]].startswith(f"({token},")  # the wrong token changed nothing
    dlq = conn.execute("SELECT original_id, failure_reason, last_exception FROM outbox_dlq")
    assert dlq.fetchall() == [(moved[0], "rejected", "boom")]


def test_a_write_over_several_claims_checks_each_row_against_its_own_token(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A flush carries the rows of several claims; each token goes out once, and each row is
    matched against its own (an equal token in another object included)."""
    first, second = uuid.uuid4(), uuid.uuid4()
    a, b = insert(conn, "q", 2, first), insert(conn, "q", 2, second)
    copy = uuid.UUID(str(first))  # equal to `first`, another object
    ids = [a[0], b[0], a[1], b[1]]
    tokens = [first, second, copy, first]  # the last names the wrong lease
    write = storage.ack(ids, tokens)
    assert outcomes.params(write)["tokens"] == [first, second, copy]
    assert outcomes.params(write)["slots"] == "{1,2,3,1}"
    (written,) = run(dsn, lambda pool: send_all(pool, write))
    assert written.matched == {0, 1, 2}
    left = conn.execute("SELECT id, acquired_token FROM outbox").fetchall()
    assert left == [(b[1], second)]


def test_a_refused_row_is_isolated_and_the_rest_of_its_write_goes_through(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    token = uuid.uuid4()
    ids = insert(conn, "d", 3, token)
    acked = insert(conn, "a", 1, token)
    conn.execute(
        sql.SQL("ALTER TABLE outbox_dlq ADD CONSTRAINT no_bad CHECK (original_id <> {})").format(
            sql.Literal(ids[1])
        )
    )
    move = storage.dead_letter(ids, [token] * 3, reasons=["rejected"] * 3, exceptions=["x"] * 3)
    dead, ack = run(dsn, lambda pool: send_all(pool, move, storage.ack(acked, [token])))
    assert dead.matched == {0, 2}
    assert list(dead.refused) == [1]
    error = dead.refused[1]
    assert type(error) is DatabaseError  # refused, neither a lost connection nor permanent
    assert error.sqlstate == "23514"
    assert "no_bad" in str(error)
    assert ack.matched == {0}  # the next statement of the pipeline is fine
    left = conn.execute("SELECT id, acquired_token FROM outbox").fetchall()
    assert left == [(ids[1], token)]  # still leased: delivered again when the lease expires


def test_a_write_resent_after_a_lost_connection_tells_unconfirmed_from_lost(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """The connection dies with an ack in flight. Sent again, the ack matches nothing: its
    row that is gone (as if the first attempt had committed) is unconfirmed, its row held by
    another token is not."""
    token, other = uuid.uuid4(), uuid.uuid4()
    gone, taken = insert(conn, "q", 2, token)
    ack = storage.ack([gone, taken], [token, token])

    async def scenario(pool: Pool) -> storage.Written:
        async with pool.connection() as pooled:
            pid = await (await pooled.execute("SELECT pg_backend_pid()")).fetchone()
        assert pid is not None
        conn.execute("DELETE FROM outbox WHERE id = %s", [gone])
        conn.execute("UPDATE outbox SET acquired_token = %s WHERE id = %s", [other, taken])
        # Waits until the backend is gone, so that the ack meets a dead connection.
        conn.execute("SELECT pg_terminate_backend(%s, 5000)", [pid[0]])
        with pytest.raises(ConnectionLost):
            await send_all(pool, ack)
        assert ack.resent
        (written,) = await send_all(pool, ack)
        return written

    written = run(dsn, scenario, max_size=1)
    assert written.matched == set()
    assert written.unconfirmed == {0}  # `gone`, the first row of the write
    assert written.refused == {}


# -- leases and housekeeping -----------------------------------------------------------------


def test_extend_leases_moves_only_the_leases_still_held(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    token = uuid.uuid4()
    ids = insert(conn, "q", 2, token)
    matched = run(
        dsn,
        lambda pool: PostgresStore(pool, QUERIES).extend_leases(ids, [token, uuid.uuid4()], 3600.0),
    )
    assert matched == {ids[0]}
    expiry = conn.execute(
        "SELECT id, lease_expires_at > now() + interval '30 minutes' FROM outbox ORDER BY id"
    ).fetchall()
    assert expiry == [(ids[0], True), (ids[1], False)]


def test_gauge_reads_are_typed(dsn: str, conn: psycopg.Connection[Any]) -> None:
    insert(conn, "q", 3, due="-10 s")
    conn.execute(
        "INSERT INTO outbox_dlq (original_id, queue, payload, deliveries_count, created_at, "
        "failure_reason) VALUES (1, 'q', 'x', 1, now(), 'rejected')"
    )

    async def scenario(
        pool: Pool,
    ) -> tuple[list[housekeeping.QueueBacklog], list[housekeeping.DlqCount]]:
        return await housekeeping.backlog(pool, QUERIES), await housekeeping.dlq_counts(
            pool, QUERIES
        )

    backlog, dlq = run(dsn, scenario)
    (row,) = backlog
    assert (row.queue, row.rows) == ("q", 3)
    assert 9 < row.oldest_pending_age < 60
    assert dlq == [housekeeping.DlqCount("q", "rejected", 1)]


# -- errors arrive as outbox_farm errors -----------------------------------------------------


def test_a_missing_table_is_a_schema_error(dsn: str, conn: psycopg.Connection[Any]) -> None:
    conn.execute("ALTER TABLE outbox RENAME TO outbox_elsewhere")
    with pytest.raises(SchemaError) as info:
        run(dsn, claim)
    assert info.value.sqlstate == "42P01"
    assert isinstance(info.value, PermanentError)
    assert isinstance(info.value, psycopg.Error)  # code catching the driver's errors still does
    assert '"outbox" does not exist' in str(info.value)
    assert isinstance(info.value.__cause__, psycopg.errors.UndefinedTable)
    with pytest.raises(SchemaError, match='"outbox" does not exist'):
        run(dsn, lambda pool: housekeeping.vacuum_state(pool, QUERIES))


@pytest.fixture
def reader_dsn(dsn: str, conn: psycopg.Connection[Any]) -> Iterator[str]:
    """A login role that may read the outbox but not write it."""
    role = f"outbox_farm_reader_{uuid.uuid4().hex[:8]}"
    ident = sql.Identifier(role)
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(ident))
    try:
        conn.execute(sql.SQL("GRANT SELECT ON outbox TO {}").format(ident))
        yield make_conninfo(dsn, user=role)
    finally:
        conn.execute(sql.SQL("DROP OWNED BY {}").format(ident))
        conn.execute(sql.SQL("DROP ROLE {}").format(ident))


def test_a_missing_privilege_is_a_privilege_error(
    reader_dsn: str, conn: psycopg.Connection[Any]
) -> None:
    insert(conn, "q", 1)
    with pytest.raises(PrivilegeError) as info:
        run(reader_dsn, claim)
    assert info.value.sqlstate == "42501"
    assert isinstance(info.value, PermanentError)
    assert "permission denied" in str(info.value)


def test_a_dropped_connection_is_connection_lost_and_the_next_call_reconnects(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    ids = insert(conn, "q", 1)

    async def scenario(pool: Pool) -> list[Message]:
        async with pool.connection() as pooled:
            pid = await (await pooled.execute("SELECT pg_backend_pid()")).fetchone()
        assert pid is not None
        conn.execute("SELECT pg_terminate_backend(%s, 5000)", [pid[0]])
        with pytest.raises(ConnectionLost) as info:
            await claim(pool)
        assert not isinstance(info.value, PermanentError)
        return await claim(pool)  # the pool dropped the broken connection

    rows = run(dsn, scenario, max_size=1)
    assert [msg.id for msg in rows] == ids


def test_a_server_that_cannot_be_reached_is_connection_lost(dsn: str) -> None:
    nowhere = make_conninfo(dsn, host="127.0.0.1", port=1, connect_timeout=1)
    with pytest.raises(ConnectionLost):
        run(nowhere, claim, min_size=0, timeout=0.5)


def test_the_listen_session_relays_notifies_and_reports_a_lost_connection(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    async def scenario() -> list[str]:
        got: list[str] = []
        async with listen(dsn, "outbox_outbox") as session:
            pid = conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND query ~ '(^|\\n)LISTEN '"
            ).fetchone()
            assert pid is not None
            conn.execute("SELECT pg_notify('outbox_outbox', 'orders')")
            await session.relay(got.append, 0.2)
            conn.execute("SELECT pg_terminate_backend(%s, 5000)", [pid[0]])
            with pytest.raises(ConnectionLost):
                await session.relay(got.append, 0.1)
        return got

    assert asyncio.run(scenario()) == ["orders"]
