"""The fleet's lease rounds on a real home database: every database held by exactly one
process, shares within one of each other, a process that leaves or dies has its
databases taken, and a taken lease is never taken twice."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Awaitable, Callable

import psycopg

from outbox_farm.db import fleet as statements
from outbox_farm.db.pool import Pool, open_pool

DATABASES = [f"tenant_{i:02d}" for i in range(10)]
TTL = 30.0


def member(name: str, fleet: str = "test") -> statements.Member:
    return statements.Member(fleet, name, "host", 1)


def share(databases: int) -> Callable[[int], int]:
    return lambda members: math.ceil(databases / members)


async def rounds(
    pool: Pool, members: list[statements.Member], ttl: float = TTL
) -> dict[str, frozenset[str]]:
    """Rounds of every member, each giving up what is above its share as a process does,
    until one pass changes nothing."""
    rule = share(len(DATABASES))
    held: dict[str, frozenset[str]] = {}
    for _ in range(10):
        before = dict(held)
        for m in members:
            got = await statements.play_round(pool, m, ttl, DATABASES, rule)
            extra = sorted(got.held)[rule(got.members) :]
            if extra:
                await statements.release(pool, m, extra)
            held[m.name] = got.held - set(extra)
        if held == before:
            return held
    raise AssertionError(f"the shares never settled: {held}")


def run(body: Callable[[Pool], Awaitable[None]], dsn: str) -> None:
    async def main() -> None:
        pool = await open_pool(dsn, max_size=4, farm=True)
        try:
            await body(pool)
        finally:
            await pool.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def leases(dsn: str) -> list[tuple[str, str]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT database, holder FROM outbox_farm_fleet_leases ORDER BY 1"
        ).fetchall()
    return [(d, h) for d, h in rows]


def test_three_processes_share_ten_databases_each_held_once(dsn: str) -> None:
    async def body(pool: Pool) -> None:
        held = await rounds(pool, [member("a"), member("b"), member("c")])
        counts = Counter(name for names in held.values() for name in names)
        assert set(counts) == set(DATABASES)
        assert set(counts.values()) == {1}
        assert max(len(names) for names in held.values()) <= math.ceil(10 / 3)

    run(body, dsn)
    assert len(leases(dsn)) == 10


def test_a_process_that_leaves_has_its_databases_taken_at_the_next_round(dsn: str) -> None:
    async def body(pool: Pool) -> None:
        a, b, c = member("a"), member("b"), member("c")
        held = await rounds(pool, [a, b, c])
        await statements.leave(pool, c)
        after = await rounds(pool, [a, b])
        assert after["a"] | after["b"] == set(DATABASES)
        assert held["c"] <= after["a"] | after["b"]
        assert not after["a"] & after["b"]

    run(body, dsn)
    assert {holder for _, holder in leases(dsn)} == {"a", "b"}


def test_a_dead_process_s_leases_are_taken_once_they_expire_not_before(dsn: str) -> None:
    async def body(pool: Pool) -> None:
        a, dead = member("a"), member("dead")
        # The dead one takes its half with a short lease, then never renews.
        first = await statements.play_round(pool, dead, 1.0, DATABASES, lambda m: 5)
        assert len(first.held) == 5
        got = await statements.play_round(pool, a, TTL, DATABASES, lambda m: 10)
        assert got.held == frozenset(DATABASES) - first.held  # the live half only
        deadline = asyncio.get_running_loop().time() + 30
        while True:
            got = await statements.play_round(pool, a, TTL, DATABASES, lambda m: 10)
            if got.held == frozenset(DATABASES):
                break
            assert asyncio.get_running_loop().time() < deadline, "expired leases never taken"
            await asyncio.sleep(0.2)
        assert got.members == 1  # the dead one's row expired with its leases

    run(body, dsn)


def test_racing_processes_never_hold_one_database_twice(dsn: str) -> None:
    """Eight processes take at once, each wanting every database: the taking statement's guard
    is what keeps each lease with one of them."""

    async def body(pool: Pool) -> None:
        members = [member(f"m{i}") for i in range(8)]

        async def greedy(m: statements.Member) -> frozenset[str]:
            got = await statements.play_round(pool, m, TTL, DATABASES, lambda n: 10)
            return got.held

        held = await asyncio.gather(*(greedy(m) for m in members))
        counts = Counter(name for names in held for name in names)
        assert set(counts.values()) <= {1}

    for _ in range(3):
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("DELETE FROM outbox_farm_fleet_leases")
        run(body, dsn)
        assert len({d for d, _ in leases(dsn)}) == len(leases(dsn))


def test_released_databases_are_free_for_the_others(dsn: str) -> None:
    async def body(pool: Pool) -> None:
        a, b = member("a"), member("b")
        got = await statements.play_round(pool, a, TTL, DATABASES, lambda m: 10)
        assert got.held == frozenset(DATABASES)
        await statements.release(pool, a, DATABASES[:4])
        other = await statements.play_round(pool, b, TTL, DATABASES, lambda m: 10)
        assert other.held == frozenset(DATABASES[:4])
        renewed = await statements.play_round(pool, a, TTL, DATABASES, lambda m: 6)
        assert renewed.held == frozenset(DATABASES[4:])

    run(body, dsn)


def test_fleets_sharing_a_home_database_do_not_see_each_other(dsn: str) -> None:
    async def body(pool: Pool) -> None:
        one = await statements.play_round(pool, member("a", "one"), TTL, DATABASES, share(10))
        two = await statements.play_round(pool, member("a", "two"), TTL, DATABASES, share(10))
        assert one.held == two.held == frozenset(DATABASES)
        assert one.members == two.members == 1

    run(body, dsn)
