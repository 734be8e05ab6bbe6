"""The load test's record of a run, and how the checker reads it beside the outbox and DLQ.

Two tables of the load test's own sit beside the farm's (which come from
`outbox_farm.ops.migrate`): `loadtest_expected`, one row per published message, written by the
publisher in the same transaction as the outbox row, with the fate the message must meet; and
`loadtest_ledger`, one row per handler run, written by the handler itself. The checker reads
them, the outbox and the DLQ through `Db`, so its queries name the farm's tables whatever they
are called.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from outbox_farm.names import TableNames

SCHEMA = """
CREATE TABLE IF NOT EXISTS loadtest_expected (
    msg_id       text PRIMARY KEY,
    queue        text NOT NULL,
    expect       text NOT NULL,            -- 'success' or the DLQ failure_reason
    fail_times   int NOT NULL DEFAULT 0,   -- handler failures before the success
    max_runs     int,                      -- handler runs allowed (max_deliveries), or NULL
    published_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS loadtest_ledger (
    msg_id  text,
    queue   text,
    outcome text,
    pid     int,
    at      timestamptz DEFAULT now(),
    run_id  uuid                        -- one handler run, to tell a lost reply from a lost row
);
CREATE INDEX IF NOT EXISTS loadtest_ledger_msg_idx ON loadtest_ledger (msg_id);
"""


def create_schema(conn: psycopg.Connection[Any]) -> None:
    """The load test's own tables (the outbox and DLQ come from `outbox_farm.ops.migrate`)."""
    conn.execute(SCHEMA)


def payload_msg_id(payload: bytes) -> str | None:
    """The message id a publisher put in the payload: outbox and DLQ rows carry no other link
    to their `loadtest_expected` row (None when the payload is not one of ours)."""
    try:
        body = json.loads(bytes(payload))
    except ValueError:
        return None
    value = body.get("id") if isinstance(body, dict) else None
    return str(value) if value is not None else None


class Db:
    """A run's database with the farm's table names filled in: `{outbox}` and `{dlq}` in a
    query stand for the configured outbox and DLQ tables."""

    def __init__(self, conn: psycopg.Connection[Any], names: TableNames) -> None:
        self.conn = conn
        ids = names.identifiers()
        self.outbox = ids["outbox"]
        self.dlq = ids["dlq"]

    def rows(self, query: str, params: Any = None) -> list[tuple[Any, ...]]:
        composed = sql.SQL(query).format(outbox=self.outbox, dlq=self.dlq)  # type: ignore[arg-type]
        return self.conn.execute(composed, params).fetchall()


@dataclass
class DlqState:
    by_msg: dict[str | None, list[tuple[str, str]]]  # msg_id -> [(queue, reason)]
    by_key: Counter[tuple[str, str]]  # (queue, reason) -> rows


def dlq_state(db: Db) -> DlqState:
    """The DLQ read once, so that every check that needs it sees the same rows."""
    by_msg: dict[str | None, list[tuple[str, str]]] = defaultdict(list)
    by_key: Counter[tuple[str, str]] = Counter()
    for queue, payload, reason in db.rows("SELECT queue, payload, failure_reason FROM {dlq}"):
        by_msg[payload_msg_id(payload)].append((queue, reason))
        by_key[(queue, reason)] += 1
    return DlqState(dict(by_msg), by_key)
