"""The harness itself: each test gets its own migrated database."""

import psycopg


def test_each_test_gets_a_migrated_database(conn: psycopg.Connection) -> None:
    row = conn.execute("SELECT to_regclass('outbox'), to_regclass('outbox_dlq')").fetchone()
    assert row == ("outbox", "outbox_dlq")
    conn.execute("INSERT INTO outbox (queue, payload) VALUES ('q', 'x')")


def test_databases_are_isolated(conn: psycopg.Connection) -> None:
    assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)
