"""Faults and leases, against a real Postgres: killed backends and a killed process lose
nothing (invariant 9); a handler runs only while its lease holds (invariant 10); a dead
worker's leases are handed back; connections do not grow with concurrency; the claim and
next-due statements stay on their partial indexes.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from contextlib import AsyncExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox_farm import Farm, Message
from outbox_farm.db.leases import release_worker
from outbox_farm.errors import ConfigurationError
from outbox_farm.names import TableNames
from outbox_farm.queries import Queries
from outbox_farm.settings import RuntimeSettings
from outbox_farm.tokens import token_range
from tests.integration.timing_kit import (
    CLIENT_BACKENDS,
    KILL_ALL,
    LEASED,
    Q,
    aconnect,
    claims,
    dead_components,
    fast_commit_dsn,  # noqa: F401  (the `dsn` fixture)
    is_empty,
    one,
    outbox_count,
)
from tests.samples import sample
from tests.steps import eventually, wait_for

# -- invariant 9: faults -------------------------------------------------------------------


def test_terminating_every_backend_repeatedly_loses_nothing(dsn: str) -> None:
    farm = Farm(dlq_table="outbox_dlq")
    handled: set[int] = set()
    together: set[int] = set()  # running "together" rows: one per live executor at most
    release = asyncio.Event()

    @farm.handler(Q, concurrency=16, lease_ttl=2.0)
    async def handle(msg: Message) -> None:
        if msg.body == b"together":
            together.add(msg.id)
            await release.wait()
        await asyncio.sleep(0.02)  # some work: rows are in flight when the backends die
        handled.add(msg.id)

    async def scenario() -> None:
        aconn = await aconnect(dsn)
        try:
            ids: list[int] = []
            for chunk in range(4):
                ids += await farm.apublish_batch(
                    aconn, [{"n": n} for n in range(chunk * 500, chunk * 500 + 500)], queue=Q
                )
            assert len(set(ids)) == 2000
            kills: list[tuple[int, int]] = []

            async def acked_below(left: int) -> bool:
                return await outbox_count(aconn) < left

            async with farm.running(dsn, poll_interval=0.5, graceful_timeout=3.0) as rt:
                await eventually(lambda: handled, "the first deliveries", timeout=3.0)
                for _ in range(3):
                    remaining = await outbox_count(aconn)
                    killed = 0

                    async def killed_some() -> bool:
                        # Between the ack that showed the runtime back and this moment, its
                        # pool may hold no connection yet: terminate once it holds one.
                        nonlocal killed
                        killed = int(await one(aconn, KILL_ALL))
                        return killed > 0

                    await eventually(killed_some, "a backend of the farm to terminate")
                    kills.append((killed, remaining))
                    # Acks land again before the next kill: the runtime has reconnected.
                    await eventually(lambda left=remaining: acked_below(left), "acks again")
                # Rows whose claim committed but whose result was lost come back after the
                # 2 s lease; the rest is handled as soon as the runtime has reconnected.
                began = time.monotonic()
                await eventually(lambda: is_empty(aconn), "the outbox to drain", timeout=15.0)
                drained = time.monotonic() - began
                assert set(ids) <= handled
                # Still running: every component, and all 16 executors (16 handlers at once).
                dead = dead_components(rt)
                assert not dead, dead
                extra = await farm.apublish_batch(aconn, ["together"] * 16, queue=Q)
                await eventually(
                    lambda: len(together) == 16, "a handler on every executor", timeout=3.0
                )
                release.set()
                await eventually(
                    lambda: set(extra) <= handled, "deliveries after the faults", timeout=3.0
                )
            print(
                f"\n(backends terminated, rows left) per kill: {kills}; drained "
                f"{drained:.1f}s after the last kill"
            )
            assert all(killed and left for killed, left in kills), kills
        finally:
            await aconn.close()

    asyncio.run(scenario())


def test_claims_resume_promptly_after_every_backend_is_killed(dsn: str) -> None:
    """A database restart, as the runtime sees it: every connection, pooled and listening,
    dies at once while the database keeps accepting new ones. The farm's own jittered backoff
    (from 50 ms) must be what paces the recovery: a pool `check=` on checkout made
    psycopg_pool sleep ~1 s, 2 s, 4 s ... inside getconn() per dead connection, silently
    (measured 2.8-3.4 s with a pool of three, up to 16 s under repeated kills)."""
    farm = Farm(dlq_table="outbox_dlq")
    handled: dict[int, float] = {}

    @farm.handler(Q)
    async def handle(msg: Message) -> None:
        handled[msg.id] = time.monotonic()

    async def scenario() -> None:
        aconn = await aconnect(dsn)
        try:
            async with farm.running(dsn, poll_interval=5.0, graceful_timeout=2.0) as rt:
                assert rt.pool is not None
                # Claims and flushes overlap in any busy runtime, so its pool holds more than
                # one connection; here two are opened by hand, then left idle.
                pool = rt.pool
                async with pool.connection(), pool.connection():
                    pass

                async def settled() -> bool:
                    stats = pool.get_stats()
                    size = stats["pool_size"]
                    clients = int(await one(aconn, CLIENT_BACKENDS))
                    return size >= 2 and stats["pool_available"] == size and clients == size + 1

                await eventually(
                    settled, "an idle pool of two or more and the listener", timeout=3.0
                )
                assert int(await one(aconn, KILL_ALL)) >= 3
                sent = time.monotonic()
                row_id = await farm.apublish(aconn, "after the restart", queue=Q)
                await eventually(
                    lambda: row_id in handled, "a delivery after the restart", timeout=10.0
                )
                took = handled[row_id] - sent
                print(f"\nfirst delivery after killing every backend: {took * 1000:.0f} ms")
                assert took < 0.75, f"claims stalled for {took:.2f}s after the restart"
        finally:
            await aconn.close()

    asyncio.run(scenario())


CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from outbox_farm import Farm

    farm = Farm(dlq_table="outbox_dlq")

    @farm.handler("q", concurrency=4, lease_ttl=1.0, timeout=120.0)
    async def handle(msg):
        print("started", msg.id, flush=True)
        await asyncio.sleep(60)  # holds its row until the test kills the process

    async def main():
        async with farm.running(sys.argv[1], poll_interval=0.2):
            await asyncio.sleep(120)  # runs until the test kills it

    asyncio.run(main())
    """
)


def test_rows_of_a_sigkilled_process_come_back_after_their_lease(
    dsn: str, conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    farm = Farm(dlq_table="outbox_dlq")
    deliveries: dict[int, int] = {}

    @farm.handler(Q, lease_ttl=60.0)  # the dead child's 1 s leases decide, not this
    async def handle(msg: Message) -> None:
        deliveries[msg.id] = msg.deliveries_count

    ids = [farm.publish(conn, {"n": n}, queue=Q) for n in range(10)]
    child_log = tmp_path / "child.log"
    with child_log.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, dsn],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).parents[2],
        )

        def holding() -> bool:
            assert proc.poll() is None, child_log.read_text()
            claimed = len(conn.execute(LEASED).fetchall()) == 8  # its capacity: 4 + prefetch 4
            return claimed and child_log.read_text().count("started") == 4

        try:
            wait_for(holding, "the child's handlers running on its claimed rows", 15, every=0.05)
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    held = {row[0] for row in conn.execute(LEASED).fetchall()}
    assert len(held) == 8  # the dead process's leases are still there

    async def scenario() -> float:
        aconn = await aconnect(dsn)
        try:
            began = time.monotonic()
            async with farm.running(dsn, poll_interval=0.2, graceful_timeout=2.0):
                await eventually(lambda: len(deliveries) == 10, "every row delivered", timeout=5.0)
                took = time.monotonic() - began
                await eventually(lambda: is_empty(aconn), "acks", timeout=2.0)
            return took
        finally:
            await aconn.close()

    took = asyncio.run(scenario())
    assert set(deliveries) == set(ids)
    assert {deliveries[i] for i in held} == {2}
    assert {deliveries[i] for i in set(ids) - held} == {1}
    print(f"\nafter SIGKILL every row delivered in {took * 1000:.0f} ms (lease_ttl 1 s)")


# -- invariant 10: a handler runs only while its lease holds --------------------------------


def test_a_prefetched_row_whose_lease_ran_short_is_handed_back_and_every_row_runs_once(
    dsn: str,
) -> None:
    """concurrency=1, lease_ttl=0.5, a 2 s handler: the prefetched row waits far past its
    lease. It is not started on a lease another runner may hold; it is handed back (its
    delivery with it) and claimed afresh, so each row runs once, and the long run keeps its
    own lease by the heartbeat."""
    farm = Farm(dlq_table="outbox_dlq")
    runs: list[tuple[int, int]] = []

    @farm.handler(Q, concurrency=1, prefetch=1, lease_ttl=0.5, timeout=5.0)
    async def handle(msg: Message) -> None:
        runs.append((msg.id, msg.deliveries_count))
        # The first run lasts four of the prefetched row's leases, on purpose.
        await asyncio.sleep(2.0 if len(runs) == 1 else 0.3)

    async def scenario() -> None:
        aconn = await aconnect(dsn)
        try:
            counts = {
                phase: sample("outbox_farm_lease_lost_total", queue=Q, phase=phase)
                for phase in ("start", "ack")
            }
            acked = sample("outbox_farm_acked_total", queue=Q)
            ids = await farm.apublish_batch(aconn, ["first", "second"], queue=Q)
            async with farm.running(dsn, poll_interval=0.05, graceful_timeout=2.0):
                await eventually(lambda: is_empty(aconn), "both rows acked", timeout=6.0)
                # A second run of either row, if one were still queued in this runtime, would
                # start before a row published now (one executor, in order): run one.
                control = await farm.apublish(aconn, "control", queue=Q)
                await eventually(
                    lambda: any(i == control for i, _ in runs), "the control row", timeout=6.0
                )
                await eventually(lambda: is_empty(aconn), "the control row acked", timeout=6.0)
            assert sorted(i for i, _ in runs) == sorted([*ids, control]), runs
            assert {d for _, d in runs} == {1}  # the hand-back took its delivery back
            assert sample("outbox_farm_lease_lost_total", queue=Q, phase="start") == (
                counts["start"] + 1
            )
            assert sample("outbox_farm_lease_lost_total", queue=Q, phase="ack") == counts["ack"]
            assert sample("outbox_farm_acked_total", queue=Q) == acked + 3
        finally:
            await aconn.close()

    asyncio.run(scenario())


def test_the_heartbeat_lets_a_handler_outlive_its_lease_and_run_once(dsn: str) -> None:
    """lease_ttl=1 and a 4 s handler, with a second runtime polling the queue all along: the
    row runs once, its lease moving on while it runs, and its ack is the only write."""
    farms = [Farm(dlq_table="outbox_dlq") for _ in range(2)]
    runs: list[tuple[int, int]] = []
    release = asyncio.Event()  # set once the lease has moved on past its first expiry
    for n, farm in enumerate(farms):

        @farm.handler(Q, lease_ttl=1.0, timeout=10.0)
        async def handle(msg: Message, n: int = n) -> None:
            runs.append((n, msg.deliveries_count))
            await release.wait()

    async def scenario() -> None:
        aconn = await aconnect(dsn)
        try:
            lost = sample("outbox_farm_lease_lost_total", queue=Q, phase="ack")
            acked = sample("outbox_farm_acked_total", queue=Q)
            row_id = await farms[0].apublish(aconn, "long", queue=Q)
            async with farms[0].running(dsn, poll_interval=0.05, graceful_timeout=6.0):
                await eventually(lambda: runs, "the handler to start", timeout=3.0)
                first = await one(
                    aconn, "SELECT lease_expires_at FROM outbox WHERE id = %s", (row_id,)
                )
                async with farms[1].running(dsn, poll_interval=0.05, graceful_timeout=6.0):
                    # A full lease past the first expiry on the database clock, the other
                    # runtime polling all along: without the heartbeat it would take the row.
                    polls = claims()
                    await eventually(
                        lambda: one(
                            aconn, "SELECT clock_timestamp() > %s + interval '1 s'", (first,)
                        ),
                        "a lease past the first expiry",
                        timeout=10.0,
                    )
                    await eventually(
                        lambda: claims() >= polls + 10, "the runtimes polling", timeout=10.0
                    )
                    later = await one(
                        aconn, "SELECT lease_expires_at FROM outbox WHERE id = %s", (row_id,)
                    )
                    assert later > first  # moved on by the heartbeat
                    release.set()
                    await eventually(lambda: is_empty(aconn), "the ack", timeout=6.0)
            assert runs == [(0, 1)]
            assert sample("outbox_farm_acked_total", queue=Q) == acked + 1
            assert sample("outbox_farm_lease_lost_total", queue=Q, phase="ack") == lost
        finally:
            await aconn.close()

    asyncio.run(scenario())


def test_a_runner_never_claims_again_a_row_it_still_runs(dsn: str) -> None:
    """The heartbeat stops (a stalled connection): the running row's lease runs out, yet its
    own runner, claiming every 50 ms, must not take it and run it a second time beside the
    first. With nobody else around, the first run's ack still holds."""
    farm = Farm(dlq_table="outbox_dlq")
    runs: list[int] = []
    release = asyncio.Event()  # set once its runner has claimed ten times past the lease

    @farm.handler(Q, concurrency=2, lease_ttl=0.5, timeout=5.0)
    async def handle(msg: Message) -> None:
        runs.append(msg.deliveries_count)
        await release.wait()

    async def scenario() -> None:
        aconn = await aconnect(dsn)
        try:
            row_id = await farm.apublish(aconn, "x", queue=Q)
            async with farm.running(dsn, poll_interval=0.05, graceful_timeout=3.0) as rt:
                await eventually(lambda: runs, "the handler to start", timeout=3.0)
                for heartbeat in rt.heartbeats:
                    await heartbeat.stop()
                await eventually(
                    lambda: one(
                        aconn,
                        "SELECT lease_expires_at < now() FROM outbox WHERE id = %s",
                        (row_id,),
                    ),
                    "the lease to run out",
                    timeout=2.0,
                )
                # Its runner claims on, every 50 ms: none of those claims may take the row.
                polls = claims()
                await eventually(lambda: claims() >= polls + 10, "ten claims past the lease")
                release.set()
                await eventually(lambda: is_empty(aconn), "the first run's ack", timeout=3.0)
            assert runs == [1]
        finally:
            await aconn.close()

    asyncio.run(scenario())


def test_a_lease_lost_while_the_handler_runs_is_found_by_the_heartbeat_and_nothing_written(
    dsn: str,
) -> None:
    farm = Farm(dlq_table="outbox_dlq")
    gate = asyncio.Event()
    runs: list[int] = []

    @farm.handler(Q, lease_ttl=0.6, timeout=5.0)
    async def handle(msg: Message) -> None:
        runs.append(msg.id)
        await gate.wait()

    async def scenario() -> None:
        aconn = await aconnect(dsn)
        try:
            lost = sample("outbox_farm_lease_lost_total", queue=Q, phase="heartbeat")
            lost_ack = sample("outbox_farm_lease_lost_total", queue=Q, phase="ack")
            acked = sample("outbox_farm_acked_total", queue=Q)
            row_id = await farm.apublish(aconn, "x", queue=Q)
            async with farm.running(dsn, poll_interval=0.05, graceful_timeout=2.0):
                await eventually(lambda: runs, "the handler to start", timeout=3.0)
                other = uuid.uuid4()  # another runner took the row over
                await aconn.execute(
                    "UPDATE outbox SET acquired_token = %s, acquired_at = now(), "
                    "lease_expires_at = now() + interval '1 hour' WHERE id = %s",
                    (other, row_id),
                )
                await eventually(
                    lambda: (
                        sample("outbox_farm_lease_lost_total", queue=Q, phase="heartbeat")
                        == lost + 1
                    ),
                    "the heartbeat to find the lease lost",
                    timeout=2.0,
                )
                finished = sample("outbox_farm_handler_seconds_count", queue=Q)
                gate.set()
                await eventually(
                    lambda: sample("outbox_farm_handler_seconds_count", queue=Q) > finished,
                    "the handler to return",
                    timeout=5.0,
                )
                # Its ack, were it written, goes out no later than that of a row published and
                # run after it: wait for that one.
                control = await farm.apublish(aconn, "control", queue=Q)
                await eventually(
                    lambda: sample("outbox_farm_acked_total", queue=Q) > acked,
                    "a later row's ack",
                    timeout=5.0,
                )
                assert control in runs
                token = await one(
                    aconn, "SELECT acquired_token FROM outbox WHERE id = %s", (row_id,)
                )
                assert token == other
            assert sample("outbox_farm_acked_total", queue=Q) == acked + 1  # the control's
            assert sample("outbox_farm_lease_lost_total", queue=Q, phase="ack") == lost_ack
        finally:
            await aconn.close()

    asyncio.run(scenario())


def test_without_the_heartbeat_a_timeout_longer_than_the_lease_is_refused() -> None:
    farm = Farm(dlq_table="outbox_dlq")

    async def handle(msg: Message) -> None:
        return None

    with pytest.raises(ConfigurationError, match=r"heartbeat=False.*lease would expire"):
        farm.handler(Q, lease_ttl=10, timeout=30, heartbeat=False)(handle)
    farm.handler(Q, lease_ttl=10, timeout=10, heartbeat=False)(handle)
    assert farm.handlers[Q].heartbeat is False


# -- a dead worker's leases, handed back by its supervisor ----------------------------------


def test_release_worker_frees_only_that_workers_rows_and_keeps_their_deliveries(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Two runtimes hold rows under worker ids that differ only in their top bit (so all 31
    bits are compared), a third row is held by a runtime without a worker id. Releasing one
    worker clears exactly its leases and keeps the deliveries its claims counted."""
    mine, other = 5, 5 + 2**30
    farms = {worker: Farm(dlq_table="outbox_dlq") for worker in (mine, other, None)}
    gate = asyncio.Event()
    held: dict[int | None, set[int]] = {worker: set() for worker in farms}
    for worker, farm in farms.items():

        @farm.handler(Q, concurrency=2, prefetch=1)
        async def handle(msg: Message, worker: int | None = worker) -> None:
            held[worker].add(msg.id)
            await gate.wait()

    ids = [farms[None].publish(conn, {"n": n}, queue=Q) for n in range(9)]

    def leased() -> dict[int, tuple[uuid.UUID, int]]:
        rows = conn.execute(
            "SELECT id, acquired_token, deliveries_count FROM outbox "
            "WHERE acquired_token IS NOT NULL"
        ).fetchall()
        return {row[0]: (row[1], row[2]) for row in rows}

    async def scenario() -> None:
        async with AsyncExitStack() as stack:
            for worker, farm in farms.items():
                await stack.enter_async_context(
                    farm.running(dsn, poll_interval=0.05, graceful_timeout=1.0, worker_id=worker)
                )
                await eventually(
                    lambda w=worker: len(held[w]) == 2, f"worker {worker} running", timeout=5.0
                )
            await eventually(lambda: len(leased()) == 9, "every row claimed", timeout=3.0)
            before = leased()
            prefixes = {token.bytes[:4].hex() for token, _ in before.values()}
            assert {f"{0x80000000 | mine:08x}", f"{0x80000000 | other:08x}"} <= prefixes
            freed = {i for i, (token, _) in before.items() if token.bytes[:4].hex() == "80000005"}
            assert len(freed) == 3

            assert release_worker(conn, farms[mine].queries, mine) == 3
            after = conn.execute(
                "SELECT id, acquired_token, acquired_at, deliveries_count FROM outbox "
                "WHERE id = ANY(%s) ORDER BY id",
                (sorted(freed),),
            ).fetchall()
            assert after == [(i, None, None, before[i][1]) for i in sorted(freed)]
            assert {i: v for i, v in leased().items() if i not in freed} == {
                i: v for i, v in before.items() if i not in freed
            }
            assert release_worker(conn, farms[mine].queries, mine) == 0
            gate.set()
            # A stop starts no handler, so the prefetched rows are run before it begins.
            await eventually(
                lambda: set(ids) <= set().union(*held.values()), "every row handled", timeout=10.0
            )

    asyncio.run(scenario())
    assert set(ids) == set().union(*held.values())


def test_worker_ids_out_of_range_are_refused() -> None:
    for bad in (-1, 2**31, 1.5, True, "7"):
        with pytest.raises(ConfigurationError, match="worker_id"):
            RuntimeSettings(worker_id=bad)  # type: ignore[arg-type]


# -- connections do not grow with concurrency ----------------------------------------------


def test_connections_do_not_grow_with_concurrency(dsn: str) -> None:
    farm = Farm(dlq_table="outbox_dlq")
    handled: set[int] = set()
    current = 0
    peak = 0

    @farm.handler(Q, concurrency=256)
    async def handle(msg: Message) -> None:
        nonlocal current, peak
        current += 1
        peak = max(peak, current)
        try:
            await asyncio.sleep(0.2)  # some work: hundreds of handlers at once
        finally:
            current -= 1
        handled.add(msg.id)

    async def scenario() -> None:
        aconn = await aconnect(dsn)
        try:
            for chunk in range(2):
                await farm.apublish_batch(aconn, [chunk * 500 + n for n in range(500)], queue=Q)
            backends: list[int] = []

            async def handled_all() -> bool:
                backends.append(int(await one(aconn, CLIENT_BACKENDS)))  # sampled meanwhile
                return len(handled) == 1000

            async with farm.running(dsn, poll_interval=0.5, graceful_timeout=3.0):
                await eventually(handled_all, "1000 rows handled", timeout=8.0)
            print(
                f"\nconcurrency 256: peak {peak} handlers on at most {max(backends)} "
                f"backends ({len(backends)} samples)"
            )
            assert peak >= 200  # it really ran that wide
            assert max(backends) <= 4, backends
        finally:
            await aconn.close()

    asyncio.run(scenario())


# -- the claim stays on its indexes --------------------------------------------------------


def _plan_nodes(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        if "Node Type" in node:
            yield node
        for value in node.values():
            yield from _plan_nodes(value)
    elif isinstance(node, list):
        for value in node:
            yield from _plan_nodes(value)


def _assert_index_plan(plan: Any, what: str, *indexes: str) -> None:
    nodes = list(_plan_nodes(plan))
    scans = [
        n
        for n in nodes
        if n["Node Type"] == "Seq Scan" and n.get("Relation Name") in ("outbox", "outbox_dlq")
    ]
    assert not scans, f"{what} sequence-scans: {scans}"
    used = {n.get("Index Name") for n in nodes}
    for index in indexes:
        assert index in used, f"{what} does not use {index}: uses {used - {None}}"


def test_the_runtime_statements_use_their_indexes(
    conn: psycopg.Connection[Any],
) -> None:
    conn.execute(
        """
        INSERT INTO outbox (queue, payload, next_attempt_at, deliveries_count,
                            acquired_token, acquired_at, lease_expires_at, ordering_key)
        SELECT 'queue-' || (g % 4), '\\x00'::bytea,
               now() + ((g % 1000) - 300) * interval '1 second',
               (g % 20 = 0)::int,
               CASE WHEN g % 20 = 0 THEN gen_random_uuid() END,
               CASE WHEN g % 20 = 0 THEN now() - (g % 120) * interval '1 second' END,
               CASE WHEN g % 20 = 0 AND g % 100 <> 0
                    THEN now() + ((g % 120) - 60) * interval '1 second' END,
               CASE WHEN g % 3 = 0 THEN 'key-' || (g % 40000) END  -- many keys, few rows each
        FROM generate_series(1, 200000) AS g
        """
    )
    conn.execute("ANALYZE outbox")
    queries = Queries(TableNames.build("outbox", "outbox_dlq"))
    cases = {
        "claim": (
            {
                "queue": "queue-1",
                "limit": 64,
                "lease_ttl": 60.0,
                "token": uuid.uuid4(),
                "held": [uuid.uuid4() for _ in range(4)],  # the tokens of claims in hand
            },
            ("outbox_pending_idx", "outbox_lease_idx", "outbox_order_idx"),
        ),
        "next_due": ({"queue": "queue-1"}, ("outbox_pending_idx", "outbox_lease_idx")),
        "extend_leases": (
            {"ids": list(range(21, 1300, 20)), "tokens": [uuid.uuid4()] * 64, "lease_ttl": 60.0},
            ("outbox_pkey",),
        ),
        "release_worker": (
            dict(zip(("low", "high"), token_range(5), strict=True)),
            ("outbox_lease_idx",),
        ),
    }
    # The completer's writes: a flush of 64 rows under two tokens, each row found by its id.
    ids, token = list(range(21, 1300, 20)), uuid.uuid4()
    flush = {"ids": ids, "slots": [1 + n % 2 for n in range(64)], "tokens": [token, token]}
    when = [datetime.now(UTC)] * 64
    cases |= {
        "ack": (flush, ("outbox_pkey",)),
        # The hand-over: the ack, then each deleted key's next row, found on the ordering index.
        "ack_next": (
            flush | {"queue": "queue-1", "lease_ttl": 60.0, "token": uuid.uuid4()},
            ("outbox_pkey", "outbox_order_idx"),
        ),
        "retry": (
            flush | {"delays": [1.0] * 64, "ran": [1] * 64, "started": when},
            ("outbox_pkey",),
        ),
        "release": (flush, ("outbox_pkey",)),
        "dlq_move": (flush | {"reasons": ["x"] * 64, "exceptions": ["e"] * 64}, ("outbox_pkey",)),
        "set_aside": (
            {"ids": ids, "token": token, "aside": token, "seconds": 1.0},
            ("outbox_pkey",),
        ),
        "lease_holders": ({"ids": ids}, ("outbox_pkey",)),
    }
    for name, (params, indexes) in cases.items():
        statement_text = queries[name]
        if not isinstance(statement_text, str):  # a psycopg `Composed`
            statement_text = statement_text.as_string(conn)
        cursor = conn.cursor()
        cursor.execute("EXPLAIN (FORMAT JSON) " + statement_text, params)
        row = cursor.fetchone()
        assert row is not None
        _assert_index_plan(row[0], f"{name} (custom plan)", *indexes)

        # The runtime re-runs these statements on pooled connections, so psycopg prepares
        # them and Postgres may switch to a generic plan: that one must hold too.
        order: list[str] = []

        def placeholder(match: re.Match[str], order: list[str] = order) -> str:
            if match.group(1) not in order:
                order.append(match.group(1))
            return f"${order.index(match.group(1)) + 1}"

        text = re.sub(r"%\((\w+)\)[sbt]", placeholder, statement_text)
        statement = sql.Identifier(f"explain_{name}")
        conn.execute(sql.SQL("PREPARE {} AS {}").format(statement, sql.SQL(text)))
        conn.execute("SET plan_cache_mode = force_generic_plan")
        try:
            cursor.execute(
                sql.SQL("EXPLAIN (FORMAT JSON) EXECUTE {}({})").format(
                    statement, sql.SQL(", ").join(sql.Literal(params[k]) for k in order)
                )
            )
            row = cursor.fetchone()
            assert row is not None
            _assert_index_plan(row[0], f"{name} (generic plan)", *indexes)
        finally:
            conn.execute("RESET plan_cache_mode")
            conn.execute(sql.SQL("DEALLOCATE {}").format(statement))
