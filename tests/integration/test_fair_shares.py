"""Fair shares per key against a real Postgres and a running farm: tenant A has 100,000 rows
waiting, and a row of tenant B published after them starts within a second on a queue limited
per key, while on a queue without the limit it waits behind A's backlog (the test's own
baseline, measured beside it). Also: a fair key on a table without migration 0014 is refused
saying to migrate, and the per-key limit cannot be set on such a table. The claim's rule
itself is in tests/contract/test_store_fair.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
import pytest

from outbox_farm import Farm, Message
from outbox_farm.admin.queues import limit_queue
from outbox_farm.errors import SchemaError
from outbox_farm.limits import Limits
from outbox_farm.names import TableNames
from outbox_farm.ops.migrate import migrate
from outbox_farm.settings import RuntimeSettings
from tests.integration.test_priority import migrate_to
from tests.steps import eventually

NAMES = TableNames.build("outbox", "outbox_dlq")
BACKLOG = 100_000
BEFORE_FAIR = 13  # the last migration before 0014 added `fair_key`


def test_a_tenants_row_starts_within_a_second_behind_another_tenants_backlog(dsn: str) -> None:
    farm = Farm()
    started: dict[str, list[float]] = {"fair": [], "plain": []}  # when A's rows started
    b_started: dict[str, float] = {}
    running = {"fair": [0, 0], "plain": [0, 0]}  # A's rows running now, and the most at once

    def handler(queue: str) -> Any:
        async def handle(msg: Message) -> None:
            if msg.body == b"b":
                b_started[queue] = time.monotonic()
                return
            started[queue].append(time.monotonic())
            now = running[queue]
            now[0] += 1
            now[1] = max(now)
            await asyncio.sleep(0.05)
            now[0] -= 1

        return handle

    for queue in started:
        farm.handler(queue, concurrency=16)(handler(queue))
    with psycopg.connect(dsn, autocommit=True) as conn:
        for queue in started:
            for _ in range(BACKLOG // 10_000):
                farm.publish_batch(conn, [b"a"] * 10_000, queue=queue, fair_key="a")

    async def scenario() -> dict[str, float]:
        published: dict[str, float] = {}
        settings = RuntimeSettings(poll_interval=0.5)
        with psycopg.connect(dsn, autocommit=True) as conn:  # before the farm's first claim
            limit_queue(conn, NAMES, "fair", key_max_running=4)
        async with farm.running(dsn, settings) as runtime:
            await eventually(
                lambda: runtime.fetchers["fair"].limits == Limits(key_max_running=4),
                "the per-key limit loaded",
            )
            await eventually(lambda: all(len(s) >= 20 for s in started.values()), "A running")
            with psycopg.connect(dsn, autocommit=True) as conn:
                for queue in started:
                    farm.publish(conn, b"b", queue=queue, fair_key="b")
                    published[queue] = time.monotonic()
            await eventually(lambda: "fair" in b_started, "B's row started", timeout=10)
            # The baseline's positive control: 100 of A's rows published before B's start
            # after it on the queue without the limit, while B's row still waits there.
            await eventually(
                lambda: sum(t > published["plain"] for t in started["plain"]) >= 100,
                "A's rows starting after B's publish",
                timeout=30,
            )
        return published

    published = asyncio.run(scenario())
    latency = b_started["fair"] - published["fair"]
    print(f"\nfair shares: B's row started {latency * 1000:.0f} ms after its publish behind")
    print(f"  {BACKLOG} rows of A, key_max_running=4 (limit: 1 s)")
    waited = "not started" if "plain" not in b_started else f"{b_started['plain']:.2f}"
    after = sum(t > published["plain"] for t in started["plain"])
    print(f"  without the limit: B {waited} while {after} rows of A started after it")
    assert latency < 1.0
    assert running["fair"][1] == 4  # A's share: its limit, every process and claim together
    assert running["plain"][1] > 4  # the positive control: unlimited, A fills the handlers
    assert "plain" not in b_started or b_started["plain"] - published["plain"] > latency
    with psycopg.connect(dsn, autocommit=True) as conn:
        leased = conn.execute(
            "SELECT count(*) FROM outbox WHERE queue = 'fair' AND acquired_token IS NOT NULL"
        ).fetchone()
    assert leased == (0,)  # the farm stopped: no lease left behind


def test_a_fair_key_on_a_table_without_the_column_says_to_migrate(empty_dsn: str) -> None:
    migrate_to(empty_dsn, BEFORE_FAIR)
    farm = Farm()
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        with conn.transaction():
            assert farm.publish(conn, b"plain", queue="q") is not None
            with pytest.raises(SchemaError) as refused:
                farm.publish(conn, b"tenant", queue="q", fair_key="a")
            assert "has no fair_key column yet (migration 0014)" in str(refused.value)
            assert "run `outbox-farm migrate`" in str(refused.value)
            with pytest.raises(SchemaError, match="outbox-farm migrate"):
                farm.publish_batch(conn, [b"t"] * 2, queue="q", fair_key="a")
            # Refused before anything was sent: the caller's transaction goes on.
            assert farm.publish(conn, b"plain", queue="q", priority=3) is not None
        with pytest.raises(SchemaError, match="migration 0014"):
            limit_queue(conn, NAMES, "q", key_max_running=2)
        assert limit_queue(conn, NAMES, "q", max_running=2).limits == Limits(max_running=2)
        with psycopg.connect(empty_dsn) as admin:
            migrate(admin, NAMES)
        # The same connection asks the catalog again before refusing: the migration is seen.
        assert farm.publish(conn, b"tenant", queue="q", fair_key="a") is not None
        state = limit_queue(conn, NAMES, "q", key_max_running=2)
        assert state.limits == Limits(max_running=2, key_max_running=2)
        row = conn.execute("SELECT count(*) FROM outbox WHERE fair_key = 'a'").fetchone()
        assert row == (1,)
