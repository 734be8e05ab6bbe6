"""Rows other writers put in the outbox (a SQL trigger, another language's producer) with values
the schema admits but the farm cannot load, count or publish (DESIGN.md invariant 13): each
ends explicitly (dead-lettered as `invalid_row` with the field and why, or set aside and
reported by id) while the good rows around it are delivered, and no claim fails because of it.

Migration 0006 refuses such rows at the door, so each test first drops its checks, as a table
that predates them (or a role that bypasses them) would hold such rows.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from typing import Any

import psycopg
import psycopg_pool
import pytest
from click.testing import CliRunner

from outbox_farm import Farm, Message
from outbox_farm.admin import queue_stats
from outbox_farm.admin.dlq import dlq_show
from outbox_farm.admin.doctor import doctor
from outbox_farm.cli import main as cli
from outbox_farm.db.claims import SET_ASIDE_TOKEN
from outbox_farm.db.pool import open_pool
from outbox_farm.db.store import PostgresStore
from outbox_farm.errors import IdentifierError
from outbox_farm.names import TableNames
from outbox_farm.queries import Queries
from outbox_farm.relay import CONFIRMED, Delivery, Envelope
from outbox_farm.relay.runner import MAX_HEADER_BYTES
from outbox_farm.settings import RuntimeSettings
from outbox_farm.storage import Claim
from tests.steps import publish, run_until

DLQ = "outbox_dlq"
NAMES = TableNames.build("outbox", DLQ)
BIGINT_MAX = 9223372036854775807
GOOD = 6  # good rows published around each bad one
SETTINGS = RuntimeSettings(poll_interval=0.05)

Conn = psycopg.Connection[Any]


def without_checks(conn: Conn) -> None:
    """The table as it was before migration 0006 (or as a role that bypasses it sees it)."""
    conn.execute("ALTER TABLE outbox DROP CONSTRAINT IF EXISTS outbox_counts_ck")
    conn.execute("ALTER TABLE outbox DROP CONSTRAINT IF EXISTS outbox_values_ck")


def insert_bad(conn: Conn, queue: str, **values: Any) -> int:
    """One row written by SQL, with `values` for the columns named."""
    columns = ["queue", "payload", *values]
    row = conn.execute(
        psycopg.sql.SQL("INSERT INTO outbox ({}) VALUES ({}) RETURNING id").format(
            psycopg.sql.SQL(", ").join(map(psycopg.sql.Identifier, columns)),
            psycopg.sql.SQL(", ").join(psycopg.sql.Placeholder() * len(columns)),
        ),
        [queue, b"bad", *values.values()],
    ).fetchone()
    assert row is not None
    return int(row[0])


def dlq_rows(conn: Conn, queue: str) -> list[tuple[int, str, str]]:
    rows = conn.execute(
        "SELECT original_id, failure_reason, last_exception FROM outbox_dlq WHERE queue = %s "
        "ORDER BY original_id",
        [queue],
    ).fetchall()
    return [(int(r[0]), str(r[1]), str(r[2])) for r in rows]


def left(conn: Conn, queue: str) -> int:
    row = conn.execute("SELECT count(*) FROM outbox WHERE queue = %s", [queue]).fetchone()
    assert row is not None
    return int(row[0])


def deliver_around(
    dsn: str, conn: Conn, bad: dict[str, Any], *, max_deliveries: int | None = 10
) -> tuple[list[int], int, list[int]]:
    """Good rows, one bad row, more good rows; run until the good ones are handled and the bad
    one has left the outbox. (good ids, bad id, ids the handler saw)."""
    without_checks(conn)
    farm = Farm(dlq_table=DLQ)
    seen: list[int] = []

    @farm.handler("q", max_deliveries=max_deliveries)
    async def handle(msg: Message) -> None:
        seen.append(msg.id)

    good = publish(conn, GOOD, queue="q")
    bad = insert_bad(conn, "q", **bad)
    good += publish(conn, GOOD, queue="q")
    conn.commit()
    with psycopg.connect(dsn, autocommit=True) as watch:
        run_until(
            farm,
            dsn,
            lambda: set(good) <= set(seen) and left(watch, "q") == 0,
            "the good rows delivered and the bad one gone",
            SETTINGS,
        )
    return good, bad, seen


# -- claim robustness: counters at their limits -------------------------------------------


def test_deliveries_count_at_bigint_max_goes_to_the_dlq_and_its_neighbours_are_delivered(
    dsn: str, conn: Conn
) -> None:
    """Today the claim's `deliveries_count + 1` overflows and every claim of the queue fails."""
    good, bad, seen = deliver_around(dsn, conn, {"deliveries_count": BIGINT_MAX})
    assert sorted(seen) == sorted(good)
    assert [(row_id, reason) for row_id, reason, _ in dlq_rows(conn, "q")] == [
        (bad, "max_deliveries")
    ]


def test_attempts_count_at_bigint_max_is_retried_without_overflow(dsn: str, conn: Conn) -> None:
    without_checks(conn)
    farm = Farm(dlq_table=DLQ)
    runs: list[int] = []

    @farm.handler("q")
    async def handle(msg: Message) -> None:
        runs.append(msg.attempts_count)
        if len(runs) == 1:
            msg.nack(0.0)

    bad = insert_bad(conn, "q", attempts_count=BIGINT_MAX)
    conn.commit()
    run_until(
        farm, dsn, lambda: len(runs) == 2 and left(conn, "q") == 0, "a retry, then an ack", SETTINGS
    )
    assert runs == [BIGINT_MAX - 2] * 2  # kept below the limit by every claim
    assert bad not in {row_id for row_id, _, _ in dlq_rows(conn, "q")}


# -- defensive loading: timestamps no client can represent ---------------------------------

TIMESTAMPS = [
    ("created_at", "infinity", "created_at: infinity is not a finite timestamp"),
    ("created_at", "-infinity", "created_at: -infinity is not a finite timestamp"),
    ("created_at", "0044-03-15 00:00:00+00 BC", "created_at: 0044-03-15 00:00:00+00 BC is outside"),
    ("created_at", "10000-01-01 00:00:00+00", "created_at: 10000-01-01 00:00:00+00 is outside"),
    ("next_attempt_at", "-infinity", "next_attempt_at: -infinity is not a finite timestamp"),
    ("next_attempt_at", "infinity", "next_attempt_at: infinity is not a finite timestamp"),
    ("next_attempt_at", "12000-06-01 00:00:00+00", "next_attempt_at: 12000-06-01"),
    ("first_attempt_at", "infinity", "first_attempt_at: infinity is not a finite timestamp"),
    ("first_attempt_at", "0001-01-01 00:00:00+00 BC", "first_attempt_at: 0001-01-01"),
    ("last_attempt_at", "-infinity", "last_attempt_at: -infinity is not a finite timestamp"),
]


@pytest.mark.parametrize(("column", "value", "why"), TIMESTAMPS)
def test_unloadable_timestamp_is_dead_lettered_as_invalid_row_naming_the_field(
    dsn: str, conn: Conn, column: str, value: str, why: str
) -> None:
    """Today the claim leases the batch and counts a delivery, then the client cannot load the
    row: the whole batch sits under an orphan lease, again and again."""
    conn.execute("SET TIME ZONE 'UTC'")
    good, bad, seen = deliver_around(dsn, conn, {column: value})
    assert sorted(seen) == sorted(good)
    [(row_id, reason, text)] = dlq_rows(conn, "q")
    assert (row_id, reason) == (bad, "invalid_row")
    assert text.startswith(why), text


def test_an_unloadable_row_past_max_deliveries_is_dead_lettered_as_max_deliveries(
    dsn: str, conn: Conn
) -> None:
    good, bad, seen = deliver_around(
        dsn, conn, {"created_at": "infinity", "deliveries_count": 50}, max_deliveries=5
    )
    assert sorted(seen) == sorted(good)
    [(row_id, reason, text)] = dlq_rows(conn, "q")
    assert (row_id, reason) == (bad, "max_deliveries")
    assert "created_at: infinity is not a finite timestamp" in text


# -- defensive loading: headers that are not an object -------------------------------------


@pytest.mark.parametrize(
    ("headers", "kind"),
    [('["a", 1]', "array"), ('"text"', "string"), ("42", "number"), ("null", "null")],
)
def test_headers_that_are_not_an_object_are_dead_lettered_as_invalid_row(
    dsn: str, conn: Conn, headers: str, kind: str
) -> None:
    """Today `Message.content_type` raises AttributeError on such a row, in every handler."""
    without_checks(conn)
    farm = Farm(dlq_table=DLQ)
    types: list[str | None] = []

    @farm.handler("h")
    async def handle(msg: Message) -> None:
        types.append(msg.content_type)

    ids = publish(conn, 2, queue="h")
    row = conn.execute(
        "INSERT INTO outbox (queue, payload, headers) VALUES ('h', 'x', %s::jsonb) RETURNING id",
        [headers],
    ).fetchone()
    assert row is not None
    ids += publish(conn, 2, queue="h")
    conn.commit()
    run_until(
        farm, dsn, lambda: len(types) == 4 and left(conn, "h") == 0, "the good rows", SETTINGS
    )
    [(row_id, reason, text)] = dlq_rows(conn, "h")
    assert (row_id, reason) == (row[0], "invalid_row")
    assert text == f"headers: a JSON {kind}, not an object"


def test_dlq_show_of_a_row_with_array_headers_and_an_infinite_created_at(conn: Conn) -> None:
    """Today `dlq show` ends in a traceback on such a row."""
    row = conn.execute(
        "INSERT INTO outbox_dlq (original_id, queue, payload, headers, deliveries_count, "
        "created_at, failure_reason, last_exception) VALUES (1, 'q', 'x', '[1, 2]', 1, "
        "'infinity', 'invalid_row', 'created_at: infinity is not a finite timestamp') "
        "RETURNING id"
    ).fetchone()
    assert row is not None
    conn.commit()
    conn.autocommit = True
    entry = dlq_show(conn, NAMES, row[0])
    assert entry is not None
    assert entry.created_at is None
    assert entry.headers == {"(not a JSON object)": [1, 2]}
    assert entry.payload.value == "x"


# -- set aside: nowhere to dead-letter -------------------------------------------------------


def test_without_a_dlq_an_unloadable_row_is_set_aside_and_reported_by_id(
    dsn: str, conn: Conn, caplog: pytest.LogCaptureFixture
) -> None:
    without_checks(conn)
    farm = Farm(dlq_table=None)
    seen: list[int] = []

    @farm.handler("q")
    async def handle(msg: Message) -> None:
        seen.append(msg.id)

    good = publish(conn, GOOD, queue="q")
    bad = insert_bad(conn, "q", created_at="infinity")
    good += publish(conn, GOOD, queue="q")
    conn.commit()

    def parked() -> bool:
        lease = conn.execute("SELECT acquired_token FROM outbox WHERE id = %s", [bad]).fetchone()
        conn.commit()
        return lease is not None and lease[0] == SET_ASIDE_TOKEN

    with caplog.at_level(logging.WARNING, logger="outbox_farm.fetcher"):
        run_until(
            farm,
            dsn,
            lambda: set(good) <= set(seen) and parked(),
            "the good rows and the park",
            SETTINGS,
        )
    assert sorted(seen) == sorted(good)
    assert left(conn, "q") == 1  # the bad row, parked
    reports = [r for r in caplog.records if getattr(r, "event", None) == "row_set_aside"]
    assert [(getattr(r, "row_id", None), getattr(r, "queue", None)) for r in reports] == [
        (bad, "q")
    ]
    assert "created_at: infinity is not a finite timestamp" in reports[0].getMessage()


def test_a_row_due_beyond_year_9999_is_claimed_only_by_a_claim_that_sweeps(
    dsn: str, conn: Conn
) -> None:
    """The fetcher sweeps every few seconds, not on every claim: a claim without `sweep`
    leaves such rows alone (and costs nothing for them); one with `sweep` takes them."""
    without_checks(conn)
    bad = insert_bad(conn, "q", next_attempt_at="infinity")
    conn.commit()

    async def scenario() -> tuple[list[int], list[int]]:
        pool = await open_pool(dsn, 1)
        try:
            took = []
            for sweep in (False, True):
                claim = Claim("q", 10, 60.0, uuid.uuid4(), sent=0.0, start_by=60.0, sweep=sweep)
                msgs = await PostgresStore(pool, Queries(NAMES)).claim(claim)
                took.append([msg.id for msg in msgs])
            return took[0], took[1]
        finally:
            await pool.close()

    near, far = asyncio.run(scenario())
    assert near == []
    assert far == [bad]


# -- what reads the outbox besides the claim -----------------------------------------------


@pytest.mark.parametrize("due", ["infinity", "-infinity"])
def test_next_due_stats_and_doctor_survive_an_infinite_due_time(
    dsn: str, conn: Conn, due: str
) -> None:
    """Today `next_due` fails on every idle fetch (backoff), and `stats` and `doctor` fail."""
    without_checks(conn)
    insert_bad(conn, "q", next_attempt_at=due)
    conn.commit()

    async def probe() -> float | None:
        pool = await open_pool(dsn, 1)
        try:
            return await PostgresStore(pool, Queries(NAMES)).next_due("q")
        finally:
            await pool.close()

    seconds = asyncio.run(probe())
    assert seconds is not None
    assert seconds <= 0 if due.startswith("-") else seconds > 1e6
    conn.autocommit = True
    [stats] = queue_stats(conn, NAMES, "q")
    assert stats.queue == "q"
    checks = doctor(conn, NAMES)
    assert checks
    assert not [c for c in checks if "cannot subtract" in c.detail or "out of range" in c.detail]


# -- relays: one outcome per row -------------------------------------------------------------


class Recording:
    """A broker that confirms everything and keeps what it was sent."""

    label = "recording"

    def __init__(self) -> None:
        self.received: list[Envelope] = []

    async def connect(self) -> None:
        pass

    async def publish(self, batch: Sequence[Envelope]) -> list[Delivery]:
        self.received.extend(batch)
        return [CONFIRMED] * len(batch)

    async def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("headers", "reason", "why"),
    [
        ('["a", 1]', "invalid_row", "headers: a JSON array, not an object"),
        ('{"huge": "' + "x" * (MAX_HEADER_BYTES + 1) + '"}', "rejected", "max_header_bytes"),
    ],
)
def test_a_relay_row_that_cannot_be_published_fails_alone(
    dsn: str, conn: Conn, headers: str, reason: str, why: str
) -> None:
    """Today one such row fails all the rows of its batch (the envelopes are built for the
    whole batch first), or is sent and makes RabbitMQ close the connection."""
    without_checks(conn)
    target = Recording()
    farm = Farm(dlq_table=DLQ)
    farm.relay("events", to=target, batch=50)
    good = publish(conn, 10, queue="events")
    row = conn.execute(
        "INSERT INTO outbox (queue, payload, headers) VALUES ('events', 'x', %s::jsonb) "
        "RETURNING id",
        [headers],
    ).fetchone()
    assert row is not None
    good += publish(conn, 10, queue="events")
    conn.commit()
    run_until(farm, dsn, lambda: left(conn, "events") == 0, "the batch settled", SETTINGS)
    assert sorted(e.row_id for e in target.received) == sorted(good)
    [(row_id, got, text)] = dlq_rows(conn, "events")
    assert (row_id, got) == (row[0], reason)
    assert why in text


# -- table names ---------------------------------------------------------------------------


@pytest.mark.parametrize("table", ["out%box", "app.out%box", "%s"])
def test_a_table_name_the_driver_cannot_carry_is_refused_at_every_entry_point(
    dsn: str, table: str
) -> None:
    """Today `--table 'out%box'` is accepted, and every claim then fails."""
    with pytest.raises(IdentifierError, match="may hold any character but '%'"):
        Farm(table=table)
    with pytest.raises(IdentifierError, match="may hold any character but '%'"):
        TableNames.build("outbox", table)
    runner = CliRunner()
    for command in (["migrate"], ["check"], ["stats"], ["dlq", "list"]):
        result = runner.invoke(cli, [*command, "--dsn", dsn, "--table", table])
        assert result.exit_code == 2, (command, result.output)
        assert "may hold any character but '%'" in result.output
    token = uuid.uuid4().hex  # a quoted name with other odd characters still works
    assert TableNames.build(f'we"ird {token}').outbox.name == f'we"ird {token}'


@pytest.mark.parametrize("kind", ["farm", "plain", "user"])
def test_headers_that_are_no_object_fail_only_their_row_through_any_pool(
    dsn: str, conn: Conn, kind: str
) -> None:
    """The claims' headers loader is on the farm's own connections (`open_pool(farm=True)`)
    and on the claim's cursor elsewhere: through either, a document that is not an object
    marks its row, and the rows around it load."""
    without_checks(conn)
    good = insert_bad(conn, "q", headers=psycopg.types.json.Jsonb({"k": "v"}))
    bad = [
        insert_bad(conn, "q", headers=psycopg.types.json.Jsonb(doc))
        for doc in ([1, 2], "text", None)
    ]
    conn.commit()

    async def claimed(pool: Any) -> dict[int, Message]:
        claim = Claim("q", 10, 60.0, uuid.uuid4(), sent=0.0, start_by=60.0)
        msgs = await PostgresStore(pool, Queries(NAMES)).claim(claim)
        return {msg.id: msg for msg in msgs}

    async def scenario() -> dict[int, Message]:
        if kind == "user":
            async with psycopg_pool.AsyncConnectionPool(
                dsn, kwargs={"autocommit": True}, min_size=1, max_size=1
            ) as pool:
                return await claimed(pool)
        pool = await open_pool(dsn, 1, farm=kind == "farm")
        try:
            return await claimed(pool)
        finally:
            await pool.close()

    msgs = asyncio.run(scenario())
    assert sorted(msgs) == sorted([good, *bad])
    assert msgs[good].headers == {"k": "v"}
    assert msgs[good].invalid is None
    for row in bad:
        assert msgs[row].invalid is not None, row
