"""Timing of the runtime, against a real Postgres.

Leases expire on the database clock (invariant 5); timers, retries and NOTIFY wake-ups fire on
time rather than at the next poll; a graceful stop finishes or releases what was claimed
(invariant 7).

Times compared with the database are taken on the database clock: Python times are converted
with an offset measured at the midpoint of one round trip, so the tests also hold against a
server on another machine.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from outbox_farm import ConstantBackoff, Farm, Message, Observer
from outbox_farm.db.store import PostgresStore
from tests.integration.timing_kit import (
    LEASED,
    LISTENER_PIDS,
    AConn,
    Q,
    aconnect,
    claims,
    clock_offset,
    column,
    due_epoch,
    fast_commit_dsn,  # noqa: F401  (the `dsn` fixture)
    is_empty,
    one,
    outbox_count,
)
from tests.samples import sample
from tests.steps import Claims, eventually

# -- invariant 5: lease expiry on the database clock ---------------------------------------


def test_expired_lease_is_claimed_again_on_the_database_clock_and_not_before(dsn: str) -> None:
    """Leases of a dead runner, stamped by SQL relative to the database's now() (no Python
    time involved). Expiry is the row's own `lease_expires_at`, whatever this runner's
    lease_ttl says: a lease that expired long ago is taken over at once, one that expires in
    ~1 s exactly then (poll_interval=5, so only the known lease expiry can wake the fetcher)
    and not a moment before on the database clock although it was taken 10 s ago (older than
    this runner's lease_ttl), and one that expires in an hour is left alone. A lease from
    before migration 0004 (no expiry) expires by this runner's lease_ttl, as it did then."""
    ttl = 1.5
    farm = Farm(dlq_table="outbox_dlq")
    started: dict[int, tuple[float, int]] = {}

    @farm.handler(Q, lease_ttl=ttl)
    async def handle(msg: Message) -> None:
        started[msg.id] = (time.time(), msg.deliveries_count)

    async def scenario() -> None:
        aconn = await aconnect(dsn)
        try:
            stale, fresh, future, legacy = [
                await farm.apublish(aconn, {"n": n}, queue=Q) for n in range(4)
            ]
            dead = uuid.uuid4()
            for row_id, expires_in in (
                (stale, "-8 s"),
                (fresh, "1 s"),
                (future, "1 hour"),
                (legacy, None),
            ):
                await aconn.execute(
                    "UPDATE outbox SET acquired_token = %s, deliveries_count = 1, "
                    "acquired_at = now() - interval '10 s', "
                    "lease_expires_at = now() + %s::interval WHERE id = %s",
                    (dead, expires_in, row_id),
                )
            expires = await one(
                aconn,
                "SELECT extract(epoch FROM lease_expires_at)::float8 FROM outbox WHERE id = %s",
                (fresh,),
            )
            offset = await clock_offset(aconn)
            async with farm.running(dsn, poll_interval=5.0, graceful_timeout=2.0):
                await eventually(
                    lambda: stale in started and legacy in started,
                    "the long-expired and the legacy lease taken over",
                    timeout=1.0,
                )

                # Not before: while the database clock is short of the expiry, the row keeps
                # the dead runner's lease.
                async def expiring() -> bool:
                    token, remaining = await one(
                        aconn,
                        "SELECT acquired_token, %s - extract(epoch FROM clock_timestamp()) "
                        "FROM outbox WHERE id = %s",
                        (expires, fresh),
                    )
                    if remaining <= 0.02:
                        return True
                    assert token == dead, f"claimed {remaining:.3f}s before the lease expired"
                    assert fresh not in started
                    return False

                await eventually(expiring, "the database clock at the lease's expiry", 5.0)
                await eventually(
                    lambda: fresh in started, "the expiring lease taken over", timeout=1.0
                )
                lateness = started[fresh][0] + offset - expires
                assert lateness >= -0.002, f"claimed {-lateness:.4f}s before the lease expired"
                assert lateness < 0.2, f"claimed {lateness:.3f}s after the lease expired"
                # The future-stamped lease is still the dead runner's.
                token, deliveries = await one(
                    aconn,
                    "SELECT acquired_token, deliveries_count FROM outbox WHERE id = %s",
                    (future,),
                )
                assert (token, deliveries) == (dead, 1)
                assert future not in started
                print(f"\nlease takeover lateness: {lateness * 1000:.1f} ms")
            assert started[stale][1] == 2  # each claim is counted
            assert started[fresh][1] == 2
            assert started[legacy][1] == 2
            assert await column(aconn, "SELECT id FROM outbox") == [future]
        finally:
            await aconn.close()

    asyncio.run(scenario())


# -- timers fire on time -------------------------------------------------------------------


def test_delayed_rows_fire_within_100ms_of_their_due_time(dsn: str) -> None:
    farm = Farm(dlq_table="outbox_dlq")
    started: dict[int, float] = {}

    @farm.handler(Q)
    async def handle(msg: Message) -> None:
        started[msg.id] = time.time()

    claims = Claims()

    async def scenario() -> None:
        aconn = await aconnect(dsn)
        try:
            offset = await clock_offset(aconn)
            async with farm.running(
                dsn, poll_interval=0.5, graceful_timeout=2.0, observers=[claims]
            ):
                # The fetcher's first claim found nothing: it rests on its poll.
                await eventually(lambda: claims.begun, "the first claim")
                # Due 150 ms apart: each fires on a wake-up of its own.
                ids = [
                    await farm.apublish(aconn, {"n": n}, queue=Q, activate_in=1.0 + 0.15 * n)
                    for n in range(3)
                ]
                soon = datetime.now(UTC) + timedelta(seconds=0.8)
                ids.append(await farm.apublish(aconn, "at", queue=Q, activate_at=soon))
                ids.append(
                    await farm.apublish(
                        aconn, "at", queue=Q, activate_at=soon + timedelta(seconds=0.37)
                    )
                )
                due = {row_id: await due_epoch(aconn, row_id) for row_id in ids}
                assert abs(due[ids[3]] - soon.timestamp()) < 1e-5
                await eventually(lambda: all(i in started for i in ids), "all timers", timeout=4.0)
            lateness = [started[i] + offset - due[i] for i in ids]
            print("\ntimer lateness (ms):", ", ".join(f"{x * 1000:.1f}" for x in lateness))
            for value in lateness:
                assert value >= -0.002, f"a timer fired {-value:.4f}s early"
                assert value < 0.1, f"a timer fired {value:.3f}s late"
            assert await outbox_count(aconn) == 0
        finally:
            await aconn.close()

    asyncio.run(scenario())


def test_retry_is_redelivered_within_100ms_of_its_due_time(dsn: str) -> None:
    farm = Farm(dlq_table="outbox_dlq")
    runs: dict[int, list[tuple[float, int, datetime]]] = {}

    @farm.handler(Q, retry=ConstantBackoff(delay=0.3))
    async def handle(msg: Message) -> None:
        runs.setdefault(msg.id, []).append((time.time(), msg.attempts_count, msg.next_attempt_at))
        if msg.attempts_count == 0:
            raise RuntimeError("first attempt fails")

    claims = Claims()

    async def scenario() -> None:
        aconn = await aconnect(dsn)
        try:
            offset = await clock_offset(aconn)
            retried = sample("outbox_farm_retried_total", queue=Q)
            async with farm.running(
                dsn, poll_interval=0.5, graceful_timeout=2.0, observers=[claims]
            ):
                await eventually(lambda: claims.begun, "the first claim")
                # One claim, three failures, one retry flush: nothing else wakes the fetcher
                # before its 0.5 s poll, so only the retry's own due time can be on time.
                ids = await farm.apublish_batch(aconn, [{"n": n} for n in range(3)], queue=Q)
                await eventually(
                    lambda: all(len(runs.get(i, ())) == 2 for i in ids),
                    "second attempts",
                    timeout=4.0,
                )
            assert sample("outbox_farm_retried_total", queue=Q) - retried == 3
            lateness = []
            for i in ids:
                (first, attempts1, _), (second, attempts2, due) = runs[i]
                assert (attempts1, attempts2) == (0, 1)
                # Never early: the backoff is the least time between the two runs. How late is
                # measured below against the due time itself (the database's: the retry
                # flush's now() + 0.3 s), not as a window on the gap, which also holds the
                # flush's own wait and so widens with the load of the machine.
                assert second - first >= 0.3
                lateness.append(second + offset - due.timestamp())
            print("\nretry lateness (ms):", ", ".join(f"{x * 1000:.1f}" for x in lateness))
            for value in lateness:
                assert -0.002 <= value < 0.1, f"retry lateness {value:.3f}s"
            assert await outbox_count(aconn) == 0
        finally:
            await aconn.close()

    asyncio.run(scenario())


def test_timer_id_deduplicates_end_to_end(dsn: str) -> None:
    farm = Farm(dlq_table="outbox_dlq")
    delivered: list[tuple[int, Any]] = []

    @farm.handler(Q)
    async def handle(msg: Message) -> None:
        delivered.append((msg.id, msg.json()))

    async def scenario() -> None:
        aconn = await aconnect(dsn)
        try:
            async with farm.running(dsn, poll_interval=0.2, graceful_timeout=2.0):
                first = await farm.apublish(
                    aconn, {"v": 1}, queue=Q, timer_id="t-1", activate_in=0.3
                )
                again = await farm.apublish(
                    aconn, {"v": 2}, queue=Q, timer_id="t-1", activate_in=0.05
                )
                other = await farm.apublish(
                    aconn, {"v": 3}, queue=Q, timer_id="t-2", activate_in=0.3
                )
                assert first is not None
                assert other is not None
                assert again is None
                await eventually(lambda: len(delivered) >= 2, "the two timers", timeout=3.0)
                await eventually(lambda: is_empty(aconn), "acks", timeout=2.0)
                # Several more polls (counted, not assumed from a sleep), any of which would have
                # delivered a duplicate.
                polls = claims()
                await eventually(lambda: claims() >= polls + 3, "three more polls", timeout=10.0)
                assert sorted(delivered) == [(first, {"v": 1}), (other, {"v": 3})]
                # The de-duplication covers live timers only: once delivered, the id is free.
                later = await farm.apublish(aconn, {"v": 4}, queue=Q, timer_id="t-1")
                assert later is not None
                await eventually(lambda: len(delivered) == 3, "the re-used timer id", timeout=2.0)
                assert delivered[-1] == (later, {"v": 4})
        finally:
            await aconn.close()

    asyncio.run(scenario())


# -- wake-up by NOTIFY ---------------------------------------------------------------------


@asynccontextmanager
async def listening(farm: Farm, dsn: str, *observers: Observer) -> AsyncIterator[Any]:
    """`farm` running with its LISTEN up and a 5 s poll: a delivery within a fraction of a
    second was woken by a NOTIFY. Yields the runtime."""
    async with farm.running(
        dsn, poll_interval=5.0, graceful_timeout=2.0, observers=observers
    ) as rt:
        assert rt.listener is not None
        await eventually(rt.listener.connected.is_set, "LISTEN", timeout=5.0)
        yield rt


def test_notify_wakes_the_fetcher_and_survives_a_killed_listener(dsn: str) -> None:
    """poll_interval=5: anything handled within 200 ms was woken by NOTIFY, anything within
    3 s by the listener's reconnect."""
    farm = Farm(dlq_table="outbox_dlq")
    started: dict[int, float] = {}

    @farm.handler(Q)
    async def handle(msg: Message) -> None:
        started[msg.id] = time.monotonic()

    async def publish_and_time(aconn: AConn, limit: float) -> float:
        sent = time.monotonic()
        row_id = await farm.apublish(aconn, "wake", queue=Q)
        assert row_id is not None
        await eventually(lambda: row_id in started, f"delivery within {limit}s", timeout=limit)
        return started[row_id] - sent

    claims = Claims()
    woken: list[float] = []  # when the listener's (re)connects woke the fetcher

    async def scenario() -> None:
        aconn = await aconnect(dsn)
        try:
            async with listening(farm, dsn, claims) as rt:
                pids = await eventually(
                    lambda: column(aconn, LISTENER_PIDS), "listener backend", timeout=2.0
                )
                assert len(pids) == 1, pids
                # Past the wake-up every (re)connect gives: the fetcher's first claim, then the
                # one the connect woke (the listener cannot connect before the fetcher's first
                # step), so that only a NOTIFY can deliver the next row before the 5 s poll.
                await eventually(lambda: len(claims.begun) >= 2, "the claim the connect woke")
                wake_all = rt.listener.on_connect

                def on_connect() -> None:
                    woken.append(time.monotonic())
                    wake_all()

                rt.listener.on_connect = on_connect
                first = await publish_and_time(aconn, 0.2)

                assert await one(aconn, "SELECT pg_terminate_backend(%s)", (pids[0],)) is True
                # Published while the listener is down: its NOTIFY is lost, the reconnect's
                # wake-all finds it long before the 5 s poll.
                lost = await publish_and_time(aconn, 3.0)

                async def new_listener() -> list[int]:
                    now = await column(aconn, LISTENER_PIDS)
                    return now if now and pids[0] not in now else []

                again = await eventually(new_listener, "the listener to reconnect", timeout=5.0)
                assert len(again) == 1, again
                await eventually(rt.listener.connected.is_set, "LISTEN again", timeout=2.0)
                await eventually(
                    lambda: woken and claims.since(woken[-1]), "the claim the reconnect woke"
                )
                after = await publish_and_time(aconn, 0.2)
                print(
                    f"\nNOTIFY latency {first * 1000:.1f} ms; during listener outage "
                    f"{lost * 1000:.0f} ms; after reconnect {after * 1000:.1f} ms"
                )
            assert await outbox_count(aconn) == 0
        finally:
            await aconn.close()

    asyncio.run(scenario())


def test_an_idle_farm_starts_the_handler_before_it_looks_for_the_next_due_row(
    dsn: str, monkeypatch: Any
) -> None:
    """After a claim that came back short (an idle farm, woken by a NOTIFY), the fetcher asks
    when the queue next has something due; the executors start on the claimed rows first, so
    that statement's set-up does not delay a handler (a fifth of a millisecond measured).
    The order is the event loop's: one pass, no wall-clock in the check."""
    farm = Farm(dlq_table="outbox_dlq")
    started: list[int] = []
    events: list[tuple[str, int]] = []  # ("take", rows claimed) and ("next_due", started)

    @farm.handler(Q)
    async def handle(msg: Message) -> None:
        started.append(msg.id)

    take, next_due = PostgresStore.claim, PostgresStore.next_due

    async def noted_take(*args: Any) -> list[Any]:
        rows = await take(*args)
        events.append(("take", len(rows)))
        return rows

    async def noted_next_due(*args: Any) -> float | None:
        events.append(("next_due", len(started)))
        return await next_due(*args)

    monkeypatch.setattr(PostgresStore, "claim", noted_take)
    monkeypatch.setattr(PostgresStore, "next_due", noted_next_due)

    async def scenario() -> None:
        aconn = await aconnect(dsn)
        try:
            async with listening(farm, dsn):
                for n in range(1, 4):
                    await farm.apublish(aconn, {"n": n}, queue=Q)
                    await eventually(lambda n=n: len(started) == n, f"delivery {n}", timeout=5.0)
                    await eventually(
                        lambda: events[-1][0] == "next_due", "the look for the next due row"
                    )
        finally:
            await aconn.close()

    asyncio.run(scenario())
    # At every look for the next due row, every row claimed so far has its handler started. A
    # wake that lands on a claim (the listener's first wake-up beside the first publish, on a
    # busy machine) adds a claim that takes nothing: it changes nothing here.
    taken, looks = 0, []
    for what, n in events:
        if what == "take":
            taken += n
        else:
            looks.append((taken, n))
    assert taken == 3, events
    assert all(started_then == claimed for claimed, started_then in looks), events
    assert sorted({claimed for claimed, _ in looks if claimed}) == [1, 2, 3], events


def test_polling_alone_delivers_when_listen_is_off(dsn: str) -> None:
    farm = Farm(dlq_table="outbox_dlq")
    started: dict[int, float] = {}

    @farm.handler(Q)
    async def handle(msg: Message) -> None:
        started[msg.id] = time.monotonic()

    async def scenario() -> None:
        aconn = await aconnect(dsn)
        try:
            async with farm.running(
                dsn, poll_interval=0.3, listen=False, graceful_timeout=2.0
            ) as rt:
                assert rt.listener is None
                assert await column(aconn, LISTENER_PIDS) == []
                for _ in range(3):
                    sent = time.monotonic()
                    row_id = await farm.apublish(aconn, "poll", queue=Q)
                    assert row_id is not None
                    await eventually(
                        lambda i=row_id: i in started, "a polled delivery", timeout=1.0
                    )
                    assert started[row_id] - sent < 0.4
                    await eventually(lambda: is_empty(aconn), "the ack")
            assert await outbox_count(aconn) == 0
        finally:
            await aconn.close()

    asyncio.run(scenario())


# -- invariant 7: graceful stop ------------------------------------------------------------


def test_graceful_stop_finishes_running_handlers_and_releases_the_rest(dsn: str) -> None:
    farm = Farm(dlq_table="outbox_dlq")
    running: set[int] = set()
    finished: set[int] = set()

    @farm.handler(Q, concurrency=2)
    async def slow(msg: Message) -> None:
        running.add(msg.id)
        await asyncio.sleep(0.5)  # still running when the stop comes, on purpose
        finished.add(msg.id)

    after = Farm(dlq_table="outbox_dlq")
    second: dict[int, int] = {}

    @after.handler(Q, concurrency=32)
    async def fast(msg: Message) -> None:
        second[msg.id] = msg.deliveries_count

    async def scenario() -> None:
        aconn = await aconnect(dsn)
        try:
            ids = [await farm.apublish(aconn, {"n": n}, queue=Q) for n in range(20)]
            acked = sample("outbox_farm_acked_total", queue=Q)
            released = sample("outbox_farm_released_total", queue=Q)
            async with farm.running(dsn, poll_interval=0.5, graceful_timeout=5.0) as rt:
                await eventually(lambda: len(running) == 2, "two running handlers", timeout=3.0)

                async def full() -> set[int]:
                    leased = await column(aconn, LEASED)
                    return set(leased) if len(leased) == 4 else set()

                # Capacity 4 (2 executors + 2 prefetched), claimed in halves.
                claimed = await eventually(full, "the fetcher to fill its capacity", timeout=2.0)
                assert running <= claimed
                waiting = claimed - running  # claimed into the inbox, never started
                began = time.monotonic()
                await rt.stop()
                took = time.monotonic() - began
            assert finished == running  # the running handlers were allowed to finish
            assert 0.2 < took < 2.0
            rows = {
                row[0]: row[1:]
                for row in await (
                    await aconn.execute(
                        "SELECT id, acquired_token, acquired_at, deliveries_count, attempts_count "
                        "FROM outbox"
                    )
                ).fetchall()
            }
            assert set(rows) == set(ids) - running  # finished rows acked, nothing else
            assert all(state == (None, None, 0, 0) for state in rows.values()), rows
            assert sample("outbox_farm_acked_total", queue=Q) - acked == 2
            assert sample("outbox_farm_released_total", queue=Q) - released == len(waiting)

            began = time.monotonic()
            async with after.running(dsn, poll_interval=5.0, graceful_timeout=2.0):
                await eventually(
                    lambda: len(second) == len(rows),
                    "the released rows to be taken at once",
                    timeout=1.0,
                )
                taken = time.monotonic() - began
                await eventually(lambda: is_empty(aconn), "acks", timeout=1.0)
            assert set(second) == set(rows)
            assert set(second.values()) == {1}  # the stop did not burn a delivery
            print(
                f"\nstop took {took * 1000:.0f} ms; released rows re-taken in {taken * 1000:.0f} ms"
            )
        finally:
            await aconn.close()

    asyncio.run(scenario())


def test_handler_past_the_graceful_timeout_is_cancelled_and_its_lease_released(
    dsn: str,
) -> None:
    farm = Farm(dlq_table="outbox_dlq")
    running: set[int] = set()
    cancelled: set[int] = set()

    @farm.handler(Q, concurrency=1)
    async def hangs(msg: Message) -> None:
        running.add(msg.id)
        try:
            await asyncio.sleep(30)  # past the graceful timeout: the stop cancels it
        except asyncio.CancelledError:
            cancelled.add(msg.id)
            raise

    async def scenario() -> None:
        aconn = await aconnect(dsn)
        try:
            row_id = await farm.apublish(aconn, "x", queue=Q)
            async with farm.running(dsn, poll_interval=0.5, graceful_timeout=0.5) as rt:
                await eventually(lambda: row_id in running, "the handler to start", timeout=3.0)
                began = time.monotonic()
                await rt.stop()
                took = time.monotonic() - began
            assert cancelled == {row_id}
            assert 0.4 < took < 2.0
            token, acquired_at, deliveries, attempts, due_now = await one(
                aconn,
                "SELECT acquired_token, acquired_at, deliveries_count, attempts_count, "
                "next_attempt_at <= now() FROM outbox WHERE id = %s",
                (row_id,),
            )
            assert (token, acquired_at) == (None, None)  # released, not left to expire
            assert (deliveries, attempts, due_now) == (1, 1, True)
        finally:
            await aconn.close()

    asyncio.run(scenario())
