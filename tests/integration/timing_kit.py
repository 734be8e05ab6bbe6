"""What the timing and fault tests share: a per-test database that commits without waiting
for fsync, times on the database clock, and small queries over the test's own connection."""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests import samples

Q = "q"
AConn = psycopg.AsyncConnection[Any]

# Listener backends: their last statement is the `listen` block right after (re)connecting,
# or the `listen_check` block after a health check, each after its comment lines. Pool
# connections only ever run the claim, next_due and the completer's statements.
LISTENER_PIDS = """
    SELECT pid FROM pg_stat_activity
    WHERE datname = current_database() AND pid <> pg_backend_pid()
      AND query ~ '(^|\\n)(LISTEN |SELECT 1$)'
"""
CLIENT_BACKENDS = """
    SELECT count(*) FROM pg_stat_activity
    WHERE datname = current_database() AND pid <> pg_backend_pid()
      AND backend_type = 'client backend'
"""
LEASED = "SELECT id FROM outbox WHERE acquired_token IS NOT NULL ORDER BY id"
KILL_ALL = """
    SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
    WHERE datname = current_database() AND pid <> pg_backend_pid()
"""


@pytest.fixture(name="dsn")
def fast_commit_dsn(dsn: str) -> str:
    """The per-test database, with `synchronous_commit = off` for every new session.

    These tests time the runtime's wake-ups to tens of milliseconds. A commit that waits for
    fsync stalls now and then for 100-300 ms on a busy disk (measured on the development
    machine: p99.9 161 ms, max 327 ms per commit; 16 ms max with this setting); that is the
    disk's latency, not the runtime's. Visibility between sessions is unchanged; only crash
    durability is relaxed.
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        name = conn.execute("SELECT current_database()").fetchone()
        assert name is not None
        conn.execute(
            sql.SQL("ALTER DATABASE {} SET synchronous_commit = off").format(
                sql.Identifier(name[0])
            )
        )
    return dsn


def claims(queue: str = Q) -> float:
    return samples.claims(queue)


async def aconnect(dsn: str) -> AConn:
    return await psycopg.AsyncConnection.connect(dsn, autocommit=True)


async def one(aconn: AConn, query: str, params: Any = None) -> Any:
    cursor = await aconn.execute(query, params)
    row = await cursor.fetchone()
    assert row is not None
    return row[0] if len(row) == 1 else row


async def column(aconn: AConn, query: str, params: Any = None) -> list[Any]:
    cursor = await aconn.execute(query, params)
    return [row[0] for row in await cursor.fetchall()]


async def clock_offset(aconn: AConn) -> float:
    """Database epoch minus Python epoch, from the round trip with the least latency."""
    best: tuple[float, float] | None = None
    for _ in range(5):
        before = time.time()
        db = await one(aconn, "SELECT extract(epoch FROM clock_timestamp())::float8")
        after = time.time()
        if best is None or after - before < best[0]:
            best = (after - before, db - (before + after) / 2)
    assert best is not None
    return best[1]


async def due_epoch(aconn: AConn, row_id: int) -> float:
    """A row's next_attempt_at, as the database stored it."""
    query = "SELECT extract(epoch FROM next_attempt_at)::float8 FROM outbox WHERE id = %s"
    return float(await one(aconn, query, (row_id,)))


async def outbox_count(aconn: AConn) -> int:
    return int(await one(aconn, "SELECT count(*) FROM outbox"))


async def is_empty(aconn: AConn) -> bool:
    return await outbox_count(aconn) == 0


def dead_components(rt: Any) -> list[str]:
    """The runtime's long-running components whose task has ended."""
    components = {f"fetcher {q}": f for q, f in rt.fetchers.items()}
    components |= {f"heartbeat {h.spec.queue}": h for h in rt.heartbeats}
    components["completer"] = rt.completer
    if rt.listener is not None:
        components["listener"] = rt.listener
    return [name for name, component in components.items() if not component.alive]
