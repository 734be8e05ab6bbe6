"""The queries KEDA scales the farm by (scaledobject.yaml of deploy/kubernetes/components/keda),
read from the manifest and run against a real database holding a backlog whose answer is known:
ready rows in two queues, rows scheduled later, rows under a live lease, rows whose lease expired,
and a queue with nothing due.

Each query runs as KEDA runs it: one statement, whose result must be a number (never NULL,
which KEDA cannot read). Both run in one transaction with a `SELECT now()`, so the expected age
is exact: now() is the transaction's start in all three.

KEDA connects as a read-only role, made by the component's keda-role.sql as it ships: the
queries give the same numbers as that role, and it can write nothing, nor read the DLQ.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from psycopg import errors, sql
from psycopg.conninfo import make_conninfo

KEDA = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "components" / "keda"
SCALED_OBJECT = KEDA / "scaledobject.yaml"
KEDA_ROLE = KEDA / "keda-role.sql"
SHIPPED_ROLE = "outbox_farm_keda"
Conn = psycopg.Connection[tuple[Any, ...]]


def query(trigger: str) -> str:
    """The `query` of the ScaledObject's trigger named `trigger`, as KEDA receives it."""
    for doc in yaml.safe_load_all(SCALED_OBJECT.read_text()):
        if doc and doc["kind"] == "ScaledObject":
            [found] = [t for t in doc["spec"]["triggers"] if t["name"] == trigger]
            return str(found["metadata"]["query"])
    raise AssertionError(f"no ScaledObject in {SCALED_OBJECT}")


READY = query("ready-rows")
AGE = query("oldest-ready-age")


def insert(conn: Conn, queue: str, due: list[datetime], lease_expires: datetime | None) -> None:
    """One row of `queue` per due time; leased (by one token, until `lease_expires`) if given."""
    token = None if lease_expires is None else uuid.uuid4()
    conn.execute(
        """
        INSERT INTO outbox (queue, payload, next_attempt_at, acquired_token, acquired_at,
                            lease_expires_at, deliveries_count)
        SELECT %(queue)s, '\\x00', due, %(token)s,
               CASE WHEN %(token)s::uuid IS NOT NULL THEN due END, %(expires)s,
               (%(token)s::uuid IS NOT NULL)::int
        FROM unnest(%(due)s::timestamptz[]) AS due
        """,
        {"queue": queue, "due": due, "token": token, "expires": lease_expires},
    )


def scaling_numbers(conn: Conn) -> tuple[datetime, Any, Any]:
    """now(), then both queries' results, in one transaction."""
    with conn.transaction():
        [(now,)] = conn.execute("SELECT now()").fetchall()
        [(ready,)] = conn.execute(READY).fetchall()
        [(age,)] = conn.execute(AGE).fetchall()
    return now, ready, age


def test_an_empty_outbox_scales_on_zero_not_on_null(conn: Conn) -> None:
    _, ready, age = scaling_numbers(conn)
    assert (ready, age) == (0, 0.0)


def test_rows_scheduled_later_or_held_are_no_backlog_and_have_no_age(conn: Conn) -> None:
    [(start,)] = conn.execute("SELECT now()").fetchall()
    insert(conn, "orders", [start + timedelta(minutes=10)] * 3, None)
    insert(conn, "emails", [start - timedelta(minutes=10)] * 2, start + timedelta(hours=1))

    _, ready, age = scaling_numbers(conn)

    assert (ready, age) == (0, 0.0)


def test_the_queries_count_the_ready_rows_and_age_the_oldest_of_a_known_backlog(
    conn: Conn,
) -> None:
    [(start,)] = conn.execute("SELECT now()").fetchall()
    second = timedelta(seconds=1)
    oldest = start - 90 * second
    # Ready: 25 in `orders` (the oldest of all due 90 s ago), 12 in `emails`.
    insert(conn, "orders", [oldest + i * second for i in range(25)], None)
    insert(conn, "emails", [start - i * second for i in range(1, 13)], None)
    # Not ready: scheduled for later, in those queues and in one with nothing else.
    insert(conn, "orders", [start + 3600 * second] * 4, None)
    insert(conn, "emails", [start + 60 * second] * 2, None)
    insert(conn, "reports", [start + 600 * second] * 3, None)
    # Not counted: held under a live lease (due long before the oldest ready row, so a query
    # that looked at them would also get the age wrong), and held under an expired lease (the
    # next claim takes those first, so they are no backlog to scale on).
    insert(conn, "orders", [start - 500 * second] * 5, start + 3600 * second)
    insert(conn, "emails", [start - 700 * second] * 3, start - 60 * second)

    now, ready, age = scaling_numbers(conn)

    assert ready == 37
    assert isinstance(age, float)
    assert age == pytest.approx((now - oldest).total_seconds(), abs=1e-6)
    assert age >= 90.0


def test_the_ready_count_is_cut_per_queue_at_the_manifest_s_limit(conn: Conn) -> None:
    [cap] = {int(n) for n in re.findall(r"LIMIT (\d+)", READY)} - {1}
    [(start,)] = conn.execute("SELECT now()").fetchall()
    conn.execute(
        """
        INSERT INTO outbox (queue, payload, next_attempt_at)
        SELECT 'orders', '\\x00', %(due)s FROM generate_series(1, %(rows)s)
        """,
        {"due": start - timedelta(seconds=5), "rows": cap + 3},
    )
    insert(conn, "emails", [start - timedelta(seconds=1)] * 2, None)

    _, ready, _ = scaling_numbers(conn)

    assert ready == cap + 2


@pytest.fixture
def as_keda(dsn: str, conn: Conn) -> Iterator[Conn]:
    """An autocommit connection of KEDA's role, made by keda-role.sql as shipped, under a name of
    this test's own (roles belong to the server, which other tests share)."""
    role = f"{SHIPPED_ROLE}_{uuid.uuid4().hex[:8]}"
    script = KEDA_ROLE.read_text()
    assert script.count(SHIPPED_ROLE) >= 4  # every statement names the role
    conn.execute(script.replace(SHIPPED_ROLE, role))
    try:
        with psycopg.connect(make_conninfo(dsn, user=role), autocommit=True) as keda:
            yield keda
    finally:
        conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_keda_s_read_only_role_reads_the_same_numbers_and_can_change_nothing(
    conn: Conn, as_keda: Conn
) -> None:
    [(start,)] = conn.execute("SELECT now()").fetchall()
    insert(conn, "orders", [start - timedelta(seconds=30 + i) for i in range(7)], None)
    insert(conn, "emails", [start + timedelta(minutes=5)], None)

    _, ready, age = scaling_numbers(as_keda)

    assert ready == 7
    assert age >= 36.0
    writes = [
        "INSERT INTO outbox (queue, payload) VALUES ('orders', '\\x00')",
        "UPDATE outbox SET attempts_count = attempts_count + 1",
        "DELETE FROM outbox",
        "SELECT count(*) FROM outbox_dlq",
    ]
    for statement in writes:
        with pytest.raises((errors.ReadOnlySqlTransaction, errors.InsufficientPrivilege)):
            as_keda.execute(statement)
    # Read-only sessions are a second guard; the privileges hold without it too.
    as_keda.execute("SET default_transaction_read_only = off")
    for statement in writes:
        with pytest.raises(errors.InsufficientPrivilege):
            as_keda.execute(statement)
    [(rows,)] = conn.execute("SELECT count(*) FROM outbox WHERE attempts_count = 0").fetchall()
    assert rows == 8
