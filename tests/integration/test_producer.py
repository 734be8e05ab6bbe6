"""Every producer rule against a real database: rows, transactions, NOTIFY, timers, batches."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from outbox_farm import Farm
from outbox_farm.errors import ConfigurationError, DatabaseError, SchemaError
from outbox_farm.names import TableNames
from outbox_farm.ops.migrate import migrate

Conn = psycopg.Connection[Any]
CHANNEL = "outbox_outbox"
QUIET = 0.5  # how long "no NOTIFY" waits


@pytest.fixture
def farm() -> Farm:
    return Farm("outbox", "outbox_dlq")


@pytest.fixture
def listener(dsn: str) -> Iterator[Conn]:
    """A separate autocommit session LISTENing on the default farm's channel."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"LISTEN {CHANNEL}")
        yield conn


def received(listener: Conn, timeout: float = QUIET) -> list[tuple[str, str]]:
    return [(n.channel, n.payload) for n in listener.notifies(timeout=timeout)]


def row(conn: Conn, row_id: int | None) -> tuple[Any, ...]:
    found = conn.execute(
        "SELECT queue, payload, headers, timer_id, next_attempt_at, acquired_token"
        " FROM outbox WHERE id = %s",
        [row_id],
    ).fetchone()
    assert found is not None, f"no row {row_id}"
    return tuple(found)


def count(conn: Conn) -> int:
    found = conn.execute("SELECT count(*) FROM outbox").fetchone()
    assert found is not None
    return int(found[0])


def seconds_from_now(conn: Conn, row_id: int | None) -> float:
    found = conn.execute(
        "SELECT extract(epoch FROM next_attempt_at - now())::float8 FROM outbox WHERE id = %s",
        [row_id],
    ).fetchone()
    assert found is not None
    return float(found[0])


def lease(conn: Conn, row_id: int | None) -> None:
    conn.execute(
        "UPDATE outbox SET acquired_token = gen_random_uuid(), acquired_at = now() WHERE id = %s",
        [row_id],
    )


# --- rows -----------------------------------------------------------------------------------


def test_publish_returns_the_id_and_writes_the_row(farm: Farm, conn: Conn) -> None:
    row_id = farm.publish(conn, b"\x00raw\xff", queue="emails", headers={"tenant": "acme"})
    assert isinstance(row_id, int)
    queue, payload, headers, timer_id, _, token = row(conn, row_id)
    assert queue == "emails"
    assert payload == b"\x00raw\xff"
    assert headers["content-type"] == "application/octet-stream"
    assert headers["tenant"] == "acme"
    assert isinstance(headers["correlation_id"], str)
    assert len(headers["correlation_id"]) == 32
    assert timer_id is None
    assert token is None
    second = farm.publish(conn, b"x", queue="emails")
    assert second is not None
    assert second > row_id
    assert row(conn, second)[2]["correlation_id"] != headers["correlation_id"]


def test_body_encodings_are_stored(farm: Farm, conn: Conn) -> None:
    text_id = farm.publish(conn, "héllo", queue="q")
    json_id = farm.publish(conn, {"order": 7, "items": ["é"]}, queue="q")
    assert row(conn, text_id)[1] == "héllo".encode()
    assert row(conn, text_id)[2]["content-type"] == "text/plain; charset=utf-8"
    assert json.loads(row(conn, json_id)[1]) == {"order": 7, "items": ["é"]}
    assert row(conn, json_id)[2]["content-type"] == "application/json"


def test_given_correlation_id_is_kept(farm: Farm, conn: Conn) -> None:
    row_id = farm.publish(conn, {"a": 1}, queue="q", correlation_id="req-42")
    assert row(conn, row_id)[2] == {"content-type": "application/json", "correlation_id": "req-42"}


def test_due_time_defaults_to_now_and_activate_in_delays(farm: Farm, conn: Conn) -> None:
    now_id = farm.publish(conn, b"x", queue="q")
    later_id = farm.publish(conn, b"x", queue="q", activate_in=timedelta(minutes=10))
    assert abs(seconds_from_now(conn, now_id)) < 2
    assert 598 < seconds_from_now(conn, later_id) <= 600


def test_activate_at_is_stored_exactly(farm: Farm, conn: Conn) -> None:
    at = datetime(2031, 5, 17, 12, 30, tzinfo=UTC)
    row_id = farm.publish(conn, b"x", queue="q", activate_at=at)
    assert row(conn, row_id)[4] == at


def test_bad_call_leaves_the_transaction_usable(farm: Farm, conn: Conn) -> None:
    with conn.transaction():
        first = farm.publish(conn, b"kept", queue="q")
        with pytest.raises(ConfigurationError):
            farm.publish(conn, b"x", queue="q", activate_in=-1)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        second = farm.publish(conn, b"also kept", queue="q")
    assert [r[0] for r in conn.execute("SELECT id FROM outbox ORDER BY id")] == [first, second]


def test_nul_in_headers_leaves_the_transaction_usable(farm: Farm, dsn: str, conn: Conn) -> None:
    bad = {"tenant": "ac\x00me"}
    with conn.transaction():
        first = farm.publish(conn, b"kept", queue="q")
        with pytest.raises(ConfigurationError, match="NUL character"):
            farm.publish(conn, b"x", queue="q", headers=bad)
        with pytest.raises(ConfigurationError, match="NUL character"):
            farm.publish_batch(conn, [b"x"], queue="q", headers=bad)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        second = farm.publish(conn, b"also kept", queue="q")

    async def scenario() -> list[int | None]:
        async with await psycopg.AsyncConnection.connect(dsn) as aconn:
            kept = [await farm.apublish(aconn, b"async kept", queue="q")]
            with pytest.raises(ConfigurationError, match="NUL character"):
                await farm.apublish(aconn, b"x", queue="q", headers=bad)
            with pytest.raises(ConfigurationError, match="NUL character"):
                await farm.apublish_batch(aconn, [b"x"], queue="q", headers=bad)
            assert aconn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
            kept.append(await farm.apublish(aconn, b"async also kept", queue="q"))
            await aconn.commit()
            return kept

    kept = asyncio.run(scenario())
    ids = [r[0] for r in conn.execute("SELECT id FROM outbox ORDER BY id")]
    assert ids == [first, second, *kept]


# --- transactions and NOTIFY ----------------------------------------------------------------


def test_rollback_leaves_no_row_and_no_notify(farm: Farm, conn: Conn, listener: Conn) -> None:
    with conn.transaction() as tx:
        row_id = farm.publish(conn, b"x", queue="q")
        assert row_id is not None
        assert count(conn) == 1
        raise psycopg.Rollback(tx)
    assert count(conn) == 0
    assert received(listener) == []


def test_nothing_is_sent_before_commit(farm: Farm, dsn: str, listener: Conn) -> None:
    with psycopg.connect(dsn) as producer:
        farm.publish(producer, b"x", queue="q")
        assert received(listener, 0.3) == []  # still in the producer's transaction
        with psycopg.connect(dsn, autocommit=True) as other:
            assert count(other) == 0
        producer.commit()
    assert received(listener) == [(CHANNEL, "q")]


def test_commit_sends_one_notify_for_many_publishes(farm: Farm, conn: Conn, listener: Conn) -> None:
    with conn.transaction():
        for n in range(5):
            farm.publish(conn, {"n": n}, queue="orders")
    assert count(conn) == 5
    assert received(listener) == [(CHANNEL, "orders")]


def test_one_notify_per_distinct_queue(farm: Farm, conn: Conn, listener: Conn) -> None:
    with conn.transaction():
        for queue in ["a", "b", "a", "c", "b"]:
            farm.publish(conn, b"x", queue=queue)
    assert sorted(received(listener)) == [(CHANNEL, "a"), (CHANNEL, "b"), (CHANNEL, "c")]


def test_autocommit_publish_notifies_at_once(farm: Farm, conn: Conn, listener: Conn) -> None:
    farm.publish(conn, b"x", queue="q")
    assert received(listener) == [(CHANNEL, "q")]


def test_no_notify_for_future_rows(farm: Farm, conn: Conn, listener: Conn) -> None:
    with conn.transaction():
        farm.publish(conn, b"x", queue="q", activate_in=60)
        farm.publish(conn, b"x", queue="q", activate_in=timedelta(seconds=1))
        farm.publish(conn, b"x", queue="q", activate_at=datetime.now(UTC) + timedelta(hours=1))
    assert count(conn) == 3
    assert received(listener) == []


def test_activate_at_in_the_past_notifies(farm: Farm, conn: Conn, listener: Conn) -> None:
    row_id = farm.publish(
        conn, b"x", queue="late", activate_at=datetime.now(UTC) - timedelta(minutes=5)
    )
    assert seconds_from_now(conn, row_id) < -290
    assert received(listener) == [(CHANNEL, "late")]


def test_farm_notify_false_sends_none(dsn: str, conn: Conn, listener: Conn) -> None:
    quiet = Farm("outbox", notify=False)
    with conn.transaction():
        quiet.publish(conn, b"x", queue="q")
        quiet.publish_batch(conn, [b"a", b"b"], queue="q")
    assert count(conn) == 3
    assert received(listener) == []


def test_per_call_notify_false_sends_none(farm: Farm, conn: Conn, listener: Conn) -> None:
    farm.publish(conn, b"x", queue="q", notify=False)
    farm.publish_batch(conn, [b"a"], queue="q", notify=False)
    assert count(conn) == 2
    assert received(listener) == []


def test_per_call_notify_true_overrides_the_farm(conn: Conn, listener: Conn) -> None:
    Farm("outbox", notify=False).publish(conn, b"x", queue="q", notify=True)
    assert received(listener) == [(CHANNEL, "q")]


# --- timers ---------------------------------------------------------------------------------


def test_timer_ignore_keeps_the_first(farm: Farm, conn: Conn) -> None:
    first = farm.publish(conn, b"first", queue="q", timer_id="t1", activate_in=60)
    assert first is not None
    second = farm.publish(conn, b"second", queue="q", timer_id="t1", activate_in=5)
    assert second is None
    assert count(conn) == 1
    queue, payload, _, timer_id, _, _ = row(conn, first)
    assert (queue, payload, timer_id) == ("q", b"first", "t1")
    assert seconds_from_now(conn, first) > 55


def test_same_timer_id_in_another_queue_is_another_timer(farm: Farm, conn: Conn) -> None:
    a = farm.publish(conn, b"a", queue="qa", timer_id="t")
    b = farm.publish(conn, b"b", queue="qb", timer_id="t")
    assert a is not None
    assert b is not None
    assert a != b


def test_ordinary_rows_are_not_deduplicated(farm: Farm, conn: Conn) -> None:
    ids = {farm.publish(conn, b"same", queue="q") for _ in range(3)}
    assert len(ids) == 3
    assert None not in ids


def test_timer_extend_moves_the_due_time_and_replaces_the_body(farm: Farm, conn: Conn) -> None:
    first = farm.publish(conn, b"old", queue="q", timer_id="t1", activate_in=60, headers={"v": 1})
    assert 55 < seconds_from_now(conn, first) <= 60
    again = farm.publish(
        conn,
        b"new",
        queue="q",
        timer_id="t1",
        activate_in=3600,
        on_timer_conflict="extend",
        headers={"v": 2},
    )
    assert again == first
    assert count(conn) == 1
    _, payload, headers, _, _, _ = row(conn, first)
    assert payload == b"new"
    assert headers["v"] == 2
    assert 3595 < seconds_from_now(conn, first) <= 3600


def test_timer_extend_can_move_a_timer_earlier_and_then_notifies(
    farm: Farm, conn: Conn, listener: Conn
) -> None:
    first = farm.publish(conn, b"old", queue="q", timer_id="t1", activate_in=3600)
    assert received(listener, 0.3) == []
    again = farm.publish(conn, b"now", queue="q", timer_id="t1", on_timer_conflict="extend")
    assert again == first
    assert abs(seconds_from_now(conn, first)) < 2
    assert received(listener) == [(CHANNEL, "q")]


def test_timer_extend_leaves_a_leased_row_alone(farm: Farm, conn: Conn) -> None:
    first = farm.publish(conn, b"running", queue="q", timer_id="t1", activate_in=0)
    lease(conn, first)
    before = row(conn, first)
    again = farm.publish(
        conn, b"new", queue="q", timer_id="t1", activate_in=3600, on_timer_conflict="extend"
    )
    assert again is None
    assert count(conn) == 1
    assert row(conn, first) == before
    assert before[1] == b"running"
    assert before[5] is not None


def test_timer_extend_without_conflict_inserts(farm: Farm, conn: Conn) -> None:
    row_id = farm.publish(conn, b"x", queue="q", timer_id="fresh", on_timer_conflict="extend")
    assert row_id is not None
    assert row(conn, row_id)[3] == "fresh"


def test_timer_conflict_sends_no_notify(farm: Farm, conn: Conn, listener: Conn) -> None:
    first = farm.publish(conn, b"x", queue="q", timer_id="t1")
    assert received(listener, 0.3) == [(CHANNEL, "q")]
    with conn.transaction():
        assert farm.publish(conn, b"y", queue="q", timer_id="t1") is None
    assert received(listener) == []
    lease(conn, first)
    with conn.transaction():
        assert (
            farm.publish(conn, b"y", queue="q", timer_id="t1", on_timer_conflict="extend") is None
        )
    assert received(listener) == []


def test_cancel_timer(farm: Farm, conn: Conn) -> None:
    kept = farm.publish(conn, b"x", queue="q", timer_id="other", activate_in=60)
    farm.publish(conn, b"x", queue="q", timer_id="t1", activate_in=60)
    assert farm.cancel_timer(conn, queue="q", timer_id="t1") is True
    assert [r[0] for r in conn.execute("SELECT id FROM outbox")] == [kept]
    assert farm.cancel_timer(conn, queue="q", timer_id="t1") is False
    assert farm.cancel_timer(conn, queue="q", timer_id="never") is False
    assert farm.cancel_timer(conn, queue="elsewhere", timer_id="other") is False
    # Cancelling frees the timer id for a new publish.
    assert farm.publish(conn, b"again", queue="q", timer_id="t1") is not None


def test_cancel_timer_leaves_a_leased_timer(farm: Farm, conn: Conn) -> None:
    row_id = farm.publish(conn, b"x", queue="q", timer_id="t1")
    lease(conn, row_id)
    assert farm.cancel_timer(conn, queue="q", timer_id="t1") is False
    assert row(conn, row_id)[5] is not None


def test_cancel_timer_is_rolled_back_with_the_transaction(farm: Farm, conn: Conn) -> None:
    farm.publish(conn, b"x", queue="q", timer_id="t1", activate_in=60)
    with conn.transaction() as tx:
        assert farm.cancel_timer(conn, queue="q", timer_id="t1") is True
        raise psycopg.Rollback(tx)
    assert count(conn) == 1


# --- batches --------------------------------------------------------------------------------


def test_publish_batch_returns_ids_in_order(farm: Farm, conn: Conn) -> None:
    bodies: list[object] = [b"zero", "one", {"two": 2}, b"three", [4]]
    ids = farm.publish_batch(conn, bodies, queue="bulk", headers={"src": "import"})
    assert len(ids) == 5
    assert len(set(ids)) == 5
    stored = {
        r[0]: (r[1], r[2], r[3])
        for r in conn.execute("SELECT id, queue, payload, headers FROM outbox")
    }
    assert [stored[i][1] for i in ids] == [b"zero", b"one", b'{"two":2}', b"three", b"[4]"]
    assert {stored[i][0] for i in ids} == {"bulk"}
    headers = [stored[i][2] for i in ids]
    assert [h["content-type"] for h in headers] == [
        "application/octet-stream",
        "text/plain; charset=utf-8",
        "application/json",
        "application/octet-stream",
        "application/json",
    ]
    assert all(h["src"] == "import" for h in headers)
    assert len({h["correlation_id"] for h in headers}) == 5  # one per row


def test_publish_batch_is_one_statement(farm: Farm, conn: Conn) -> None:
    with conn.transaction():
        conn.execute("SELECT 1")
        ids = farm.publish_batch(conn, [b"a", b"b", b"c", b"d"], queue="q")
        # Rows written by one statement share its transaction id and command id.
        stamps = conn.execute(
            "SELECT DISTINCT xmin::text, cmin::text FROM outbox WHERE id = ANY(%s)", [ids]
        ).fetchall()
    assert len(stamps) == 1


def test_publish_batch_sends_one_notify(farm: Farm, conn: Conn, listener: Conn) -> None:
    farm.publish_batch(conn, [b"x"] * 20, queue="bulk")
    assert count(conn) == 20
    assert received(listener) == [(CHANNEL, "bulk")]


def test_future_batch_sends_no_notify(farm: Farm, conn: Conn, listener: Conn) -> None:
    ids = farm.publish_batch(conn, [b"x", b"y"], queue="q", activate_in=60)
    assert all(seconds_from_now(conn, i) > 55 for i in ids)
    assert received(listener) == []


def test_rolled_back_batch_leaves_nothing(farm: Farm, conn: Conn, listener: Conn) -> None:
    with conn.transaction() as tx:
        farm.publish_batch(conn, [b"x", b"y"], queue="q")
        raise psycopg.Rollback(tx)
    assert count(conn) == 0
    assert received(listener) == []


def test_empty_batch_returns_nothing_and_writes_nothing(
    farm: Farm, conn: Conn, listener: Conn
) -> None:
    assert farm.publish_batch(conn, [], queue="q") == []
    assert count(conn) == 0
    assert received(listener) == []


# --- async ----------------------------------------------------------------------------------


def test_async_variants(farm: Farm, dsn: str, conn: Conn, listener: Conn) -> None:
    async def scenario() -> tuple[int | None, list[int], bool, bool]:
        async with await psycopg.AsyncConnection.connect(dsn) as aconn:
            one = await farm.apublish(aconn, {"a": 1}, queue="aq", correlation_id="c-1")
            many = await farm.apublish_batch(aconn, [b"x", b"y"], queue="aq")
            await farm.apublish(aconn, b"t", queue="aq", timer_id="t1", activate_in=60)
            dup = await farm.apublish(aconn, b"t2", queue="aq", timer_id="t1")
            assert dup is None
            assert await farm.apublish_batch(aconn, [], queue="aq") == []
            cancelled = await farm.acancel_timer(aconn, queue="aq", timer_id="t1")
            missing = await farm.acancel_timer(aconn, queue="aq", timer_id="t1")
            await aconn.commit()
        return one, many, cancelled, missing

    one, many, cancelled, missing = asyncio.run(scenario())
    assert cancelled is True
    assert missing is False
    assert isinstance(one, int)
    assert len(many) == 2
    assert many == sorted(many)
    assert one < many[0]
    assert row(conn, one)[2] == {"content-type": "application/json", "correlation_id": "c-1"}
    assert [
        r[0]
        for r in conn.execute("SELECT payload FROM outbox WHERE id = ANY(%s) ORDER BY id", [many])
    ] == [b"x", b"y"]
    assert count(conn) == 3
    assert received(listener) == [(CHANNEL, "aq")]


def test_async_rollback_leaves_nothing(farm: Farm, dsn: str, conn: Conn, listener: Conn) -> None:
    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(dsn) as aconn:
            await farm.apublish(aconn, b"x", queue="q")
            await farm.apublish_batch(aconn, [b"y"], queue="q")
            await aconn.rollback()

    asyncio.run(scenario())
    assert count(conn) == 0
    assert received(listener) == []


# --- other table names ----------------------------------------------------------------------


def test_schema_qualified_farm_publishes_on_its_channel(empty_dsn: str) -> None:
    farm = Farm("app.jobs", "app.jobs_dlq")
    with (
        psycopg.connect(empty_dsn, autocommit=True) as conn,
        psycopg.connect(empty_dsn, autocommit=True) as listener,
    ):
        conn.execute("CREATE SCHEMA app")
        migrate(conn, TableNames.build("app.jobs", "app.jobs_dlq"))
        listener.execute("LISTEN outbox_jobs")
        row_id = farm.publish(conn, b"x", queue="q")
        stored = conn.execute("SELECT payload FROM app.jobs WHERE id = %s", [row_id]).fetchone()
        assert stored == (b"x",)
        assert received(listener) == [("outbox_jobs", "q")]


# --- errors ---------------------------------------------------------------------------------


def test_missing_table_is_a_schema_error(farm: Farm, empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        calls: list[Callable[[], object]] = [
            lambda: farm.publish(conn, b"x", queue="q"),
            lambda: farm.publish_batch(conn, [b"x"], queue="q"),
            lambda: farm.cancel_timer(conn, queue="q", timer_id="t"),
        ]
        for call in calls:
            with pytest.raises(SchemaError) as info:
                call()
            assert "`outbox-farm migrate`" in str(info.value)
            assert "outbox table outbox does not exist" in str(info.value)
            assert isinstance(info.value, psycopg.Error)
            assert isinstance(info.value, DatabaseError)
            assert isinstance(info.value.__cause__, psycopg.errors.UndefinedTable)


def test_missing_renamed_table_names_it(dsn: str) -> None:
    with (
        psycopg.connect(dsn, autocommit=True) as conn,
        pytest.raises(SchemaError, match="outbox table jobs does not exist"),
    ):
        Farm("jobs").publish(conn, b"x", queue="q")


def test_async_missing_table_is_a_schema_error(farm: Farm, empty_dsn: str) -> None:
    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True) as aconn:
            with pytest.raises(SchemaError, match="outbox-farm migrate"):
                await farm.apublish(aconn, b"x", queue="q")
            with pytest.raises(SchemaError, match="outbox-farm migrate"):
                await farm.apublish_batch(aconn, [b"x"], queue="q")
            with pytest.raises(SchemaError, match="outbox-farm migrate"):
                await farm.acancel_timer(aconn, queue="q", timer_id="t")

    asyncio.run(scenario())


def test_other_database_errors_are_database_errors(farm: Farm, dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1/0")
        with pytest.raises(DatabaseError) as info:
            farm.publish(conn, b"x", queue="q")  # the transaction is aborted
        assert not isinstance(info.value, SchemaError)
        assert isinstance(info.value, psycopg.Error)
        assert "outbox write failed" in str(info.value)
