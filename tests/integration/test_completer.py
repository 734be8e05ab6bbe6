"""The completer counts a write as done only for the lease it was made under, and tells a
write lost to another lease from one whose reply was lost."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from outbox_farm.db.store import PostgresStore
from outbox_farm.handler import HandlerSpec
from outbox_farm.limits import Limits, parse_rate
from outbox_farm.message import Message
from outbox_farm.metrics import metrics
from outbox_farm.names import TableNames
from outbox_farm.observe import observers
from outbox_farm.outcome import Kind, Outcome, Reason
from outbox_farm.queries import Queries
from outbox_farm.storage import Claim
from outbox_farm.worker.completer import AT_ONCE, STREAM_GAP, Completer
from outbox_farm.worker.fetcher import Fetcher
from outbox_farm.worker.inbox import Inbox
from outbox_farm.worker.inflight import Ledger

metrics()  # register the collectors before the first sample is read


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(f"outbox_farm_{name}_total", labels) or 0.0


def test_a_stale_and_a_current_outcome_of_one_row_in_one_flush(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Two deliveries of one row whose outcomes land in one flush: only the one that holds
    the lease is counted as acked (or archived); the other is a lease_lost."""
    stale, current = uuid.uuid4(), uuid.uuid4()
    ids = []
    for queue in ("stale_ack", "stale_terminal"):
        row = conn.execute(
            "INSERT INTO outbox (queue, payload, acquired_token, acquired_at, deliveries_count)"
            " VALUES (%s, 'x', %s, now(), 2) RETURNING id",
            [queue, current],
        ).fetchone()
        assert row is not None
        ids.append(row[0])

    def counts() -> list[float]:
        return [
            _sample("acked", queue="stale_ack"),
            _sample("lease_lost", queue="stale_ack", phase="ack"),
            _sample("dlq_written", queue="stale_terminal", reason="retry_terminal"),
            _sample("lease_lost", queue="stale_terminal", phase="terminal"),
        ]

    before = counts()

    async def flush() -> None:
        queries = Queries(TableNames.build("outbox", "outbox_dlq"))
        async with AsyncConnectionPool(dsn, kwargs={"autocommit": True}, open=False) as pool:
            terminal = {"reason": Reason.RETRY_TERMINAL, "last_exception": "x"}
            await Completer(PostgresStore(pool, queries)).write(
                [
                    Outcome(Kind.ACK, ids[0], stale, "stale_ack", 1),
                    Outcome(Kind.ACK, ids[0], current, "stale_ack", 2),
                    Outcome(Kind.TERMINAL, ids[1], stale, "stale_terminal", 1, **terminal),
                    Outcome(Kind.TERMINAL, ids[1], current, "stale_terminal", 2, **terminal),
                ]
            )

    asyncio.run(flush())
    after = counts()
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 1, 1]
    assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)
    assert conn.execute("SELECT count(*) FROM outbox_dlq").fetchone() == (1,)


@pytest.mark.parametrize("connection_lost", [True, False], ids=["resent", "first-try"])
def test_a_resent_ack_that_finds_its_row_gone_is_unconfirmed_not_lease_lost(
    dsn: str, conn: psycopg.Connection[Any], connection_lost: bool
) -> None:
    """The completer's connection dies with its ack in flight; the ack had committed (here:
    the row is deleted just before, as the first attempt would have). Sent again, it matches
    nothing: a row that is gone is outcome_unconfirmed; a row held under another token is
    still lease_lost. Without a lost connection, both are lease_lost as before."""
    queue = f"unconfirmed_{connection_lost}"
    token, other = uuid.uuid4(), uuid.uuid4()
    ids = []
    for _ in range(2):
        row = conn.execute(
            "INSERT INTO outbox (queue, payload, acquired_token, acquired_at, lease_expires_at,"
            " deliveries_count) VALUES (%s, 'x', %s, now(), now() + interval '1 minute', 1)"
            " RETURNING id",
            [queue, token],
        ).fetchone()
        assert row is not None
        ids.append(row[0])
    gone, taken = ids
    before = {
        name: _sample(name, queue=queue, phase="ack")
        for name in ("outcome_unconfirmed", "lease_lost")
    }
    acked = _sample("acked", queue=queue)

    async def flush() -> None:
        queries = Queries(TableNames.build("outbox", "outbox_dlq"))
        pool = AsyncConnectionPool(
            dsn, min_size=1, max_size=1, kwargs={"autocommit": True}, open=False
        )
        async with pool:
            async with pool.connection() as pooled:
                pid = await (await pooled.execute("SELECT pg_backend_pid()")).fetchone()
            conn.execute("DELETE FROM outbox WHERE id = %s", [gone])
            conn.execute("UPDATE outbox SET acquired_token = %s WHERE id = %s", [other, taken])
            if connection_lost:
                assert pid is not None
                # Waits until the backend is gone, so that the ack meets a dead connection.
                conn.execute("SELECT pg_terminate_backend(%s, 5000)", [pid[0]])
            await Completer(PostgresStore(pool, queries)).write(
                [Outcome(Kind.ACK, i, token, queue, 1) for i in (gone, taken)]
            )

    asyncio.run(flush())
    after = {
        name: _sample(name, queue=queue, phase="ack")
        for name in ("outcome_unconfirmed", "lease_lost")
    }
    expected = (
        {"outcome_unconfirmed": 1, "lease_lost": 1}
        if connection_lost
        else {
            "outcome_unconfirmed": 0,
            "lease_lost": 2,
        }
    )
    assert {name: after[name] - before[name] for name in after} == expected
    assert _sample("acked", queue=queue) == acked
    assert conn.execute("SELECT acquired_token FROM outbox WHERE id = %s", [taken]).fetchone() == (
        other,
    )


def test_put_and_put_all_wait_while_the_completer_is_high_water_behind(dsn: str) -> None:
    """Executors stop handing over outcomes while `high_water` of them wait unwritten: a batch
    handler's whole batch waits as one row's outcome does, and both go on, in the order they
    came, as flushes take what is waiting."""

    def acks(first: int, count: int) -> list[Outcome]:
        return [Outcome(Kind.ACK, i, uuid.uuid4(), "q", 1) for i in range(first, first + count)]

    async def settled() -> None:  # let every task run up to its next wait (no clock involved)
        for _ in range(10):
            await asyncio.sleep(0)

    async def scenario() -> None:
        queries = Queries(TableNames.build("outbox", "outbox_dlq"))
        async with AsyncConnectionPool(dsn, kwargs={"autocommit": True}, open=False) as pool:
            completer = Completer(PostgresStore(pool, queries), flush_size=5, high_water=5)
            await completer.put_all(acks(0, 5))  # under the mark when it came: taken at once
            batch = asyncio.create_task(completer.put_all(acks(5, 6)))
            single = asyncio.create_task(completer.put(acks(11, 1)[0]))
            await settled()
            assert not batch.done()
            assert not single.done()
            first = await completer._collect()
            assert [o.row_id for o in first] == [0, 1, 2, 3, 4]
            await settled()
            assert batch.done()  # the batch went in whole, past the mark ...
            assert not single.done()  # ... so the next outcome waits again
            second = await completer._collect()
            assert [o.row_id for o in second] == [5, 6, 7, 8, 9, 10]
            await settled()
            assert single.done()
            assert [o.row_id for o in await completer._collect()] == [11]

    asyncio.run(scenario())


def test_an_outcome_goes_at_once_when_the_process_holds_only_a_handful(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """With nothing else held, no more outcomes are coming: the batch is written now, not
    `flush_interval` (an hour here) after its first outcome, keyed or not (the next row of a
    key cannot be claimed before this one's ack; the write would otherwise land on a later
    message's claim). More than a handful held, a held row whose outcome is still to come, or
    an unkeyed outcome within `STREAM_GAP` of the last write (a stream) while the fetcher can
    claim more without it, keep the interval."""
    token = uuid.uuid4()
    row = conn.execute(
        "INSERT INTO outbox (queue, payload, ordering_key, acquired_token, acquired_at)"
        " VALUES ('q', 'x', 'k', %s, now()) RETURNING id",
        [token],
    ).fetchone()
    assert row is not None

    async def scenario() -> None:
        queries = Queries(TableNames.build("outbox", "outbox_dlq"))
        ledger = Ledger("q", 16, observers())
        ledger.hold([row[0]], token)
        ledger.keyed = True
        async with AsyncConnectionPool(dsn, kwargs={"autocommit": True}, open=False) as pool:
            completer = Completer(PostgresStore(pool, queries), flush_interval=3600)
            fetcher = _Fetcher("q", ledger)
            completer.connect({"q": fetcher})
            await completer.put(Outcome(Kind.ACK, row[0], token, "q", 1))
            assert completer.awaited(len(completer._pending))
            batch = await asyncio.wait_for(completer._collect(), 30)
            await completer.write(batch)
            assert len(ledger) == 0
            ledger.hold(range(1000, 1000 + AT_ONCE + 1), token)
            completer._pending = [Outcome(Kind.ACK, i, token, "q", 1) for i in ledger.rows]
            assert not completer.awaited(
                len(completer._pending)
            )  # a busy process keeps its batches
            ledger.keyed = False
            completer._pending = completer._pending[:1]
            ledger.settle_all([(i, token) for i in list(ledger.rows)[2:]])
            assert not completer.awaited(1)  # the other held row's outcome is still to come
            ledger.settle_all([(i, token) for i in list(ledger.rows)[1:]])
            # An unkeyed row's, alone, goes at once too, unless the last write was just now:
            # outcomes that close together are a stream, whose writes keep their batches. (A
            # minute ahead: however slow the machine, the check sees that write as just now.)
            completer.written_at = time.monotonic() + 60
            assert not completer.awaited(1)
            ledger.keyed = True  # a key's next row waits for this ack: it goes all the same
            assert completer.awaited(1)
            ledger.keyed = False
            fetcher.has_room = False  # the next claim waits for this write: it goes too
            assert completer.awaited(1)
            fetcher.has_room = True
            completer.written_at = time.monotonic() - STREAM_GAP  # the last write, longer ago
            assert completer.awaited(1)
            # Under a running limit, each outcome frees a place: it goes at once, however
            # many rows are held and still running.
            ledger.hold(range(2000, 2000 + AT_ONCE + 1), token)
            assert not completer.awaited(1)
            fetcher.running_limited = True
            assert completer.awaited(1)

    asyncio.run(scenario())
    assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)


def test_a_fetcher_has_room_while_its_next_claim_waits_for_no_write(dsn: str) -> None:
    """What the completer asks before it holds a stream's outcomes for their batch: the queue's
    fetcher would claim its next rows without their write. Not once a claim's worth of slots
    is taken (one running, one prefetched: two rows), nor while an operator holds the queue,
    nor under farm-wide limits. And whether a running limit holds it, under which every
    outcome is written at once: a written row's place is what the next claim waits for."""

    async def scenario() -> None:
        queries = Queries(TableNames.build("outbox", "outbox_dlq"))
        spec = HandlerSpec(queue="roomy", func=lambda msg: None, concurrency=1, prefetch=1)
        async with AsyncConnectionPool(dsn, kwargs={"autocommit": True}, open=False) as pool:
            store = PostgresStore(pool, queries)
            fetcher = Fetcher(spec, store, Inbox(), observers(), Completer(store))
            token = uuid.uuid4()
            assert fetcher.has_room
            fetcher.ledger.hold([1], token)
            assert fetcher.has_room  # one slot left: a claim's worth (one row)
            fetcher.ledger.hold([2], token)
            assert not fetcher.has_room
            fetcher.ledger.settle_all([(2, token)])
            assert fetcher.has_room
            fetcher.hold("an operator's pause")
            assert not fetcher.has_room
            fetcher.release()
            assert not fetcher.running_limited
            fetcher.limit(Limits(max_running=1))
            assert not fetcher.has_room
            assert fetcher.running_limited
            fetcher.limit(Limits(key_max_running=2))
            assert fetcher.running_limited
            fetcher.limit(Limits(rate=parse_rate("10/s")))
            assert not fetcher.has_room  # the rate decides when it claims
            assert not fetcher.running_limited  # but no write frees a place
            fetcher.limit(Limits())
            assert fetcher.has_room

    asyncio.run(scenario())


class _Fetcher:
    """A queue's fetcher as the completer sees it (`channels.Fetching`): its ledger, the
    hand-over claim it asks for, and what it was handed."""

    def __init__(self, queue: str, ledger: Ledger) -> None:
        self.queue = queue
        self.ledger = ledger
        self.token = uuid.uuid4()
        self.taken: list[list[Message]] = []
        self.hands_over = True  # neither paused nor limited: the hand-over may claim
        self.has_room = True  # and its fetcher's next claim waits for no write
        self.running_limited = False  # nor under a running limit

    def note_due(self, delay: float) -> None:
        pass

    def handover(self) -> Claim:
        return Claim(self.queue, None, 30.0, self.token, sent=0.0, start_by=30.0)

    async def handed(self, claim: Claim, messages: list[Message], seconds: float) -> None:
        assert claim.token == self.token
        self.taken.append(messages)


def _keyed(conn: psycopg.Connection[Any], queue: str, token: uuid.UUID, due: str) -> list[int]:
    """The head of key `k` of `queue`, leased under `token`, and the row behind it, due `due`
    (an interval) from now."""
    ids = []
    for leased, after in ((True, "0 s"), (False, due)):
        row = conn.execute(
            "INSERT INTO outbox (queue, payload, ordering_key, acquired_token, acquired_at,"
            " next_attempt_at) VALUES (%s, 'x', 'k', %s, CASE WHEN %s THEN now() END,"
            " now() + %s::interval) RETURNING id",
            [queue, token if leased else None, leased, after],
        ).fetchone()
        assert row is not None
        ids.append(row[0])
    return ids


async def _handover(dsn: str, queue: str, head: int, token: uuid.UUID) -> _Fetcher:
    """The ack of `head` by a completer whose process holds nothing else of the keyed `queue`."""
    queries = Queries(TableNames.build("outbox", "outbox_dlq"))
    ledger = Ledger(queue, 16, observers())
    ledger.hold([head], token)
    ledger.keyed = True
    claimer = _Fetcher(queue, ledger)
    async with AsyncConnectionPool(dsn, kwargs={"autocommit": True}, open=False) as pool:
        completer = Completer(PostgresStore(pool, queries))
        completer.connect({queue: claimer})
        await completer.write([Outcome(Kind.ACK, head, token, queue, 1)])
    assert len(ledger) == 0
    return claimer


def _listening(dsn: str) -> psycopg.Connection[Any]:
    listener = psycopg.connect(dsn, autocommit=True)
    listener.execute("LISTEN outbox_outbox")
    return listener


def _woken(dsn: str, listener: psycopg.Connection[Any]) -> list[str]:
    """The queues named on the farm's channel before a marker sent now: notifications arrive
    in commit order, so whatever the write sent is read before the marker."""
    with psycopg.connect(dsn, autocommit=True) as other:
        other.execute("SELECT pg_notify('outbox_outbox', 'marker')")
    seen: list[str] = []
    for note in listener.notifies(timeout=30):
        if note.payload == "marker":
            return seen
        seen.append(note.payload)
    raise AssertionError("the marker notification never arrived")


def test_the_ack_of_a_hot_keys_row_claims_the_next_row_of_the_key(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A process that holds nothing but a keyed row: its ack takes the next row of the key in
    the same statement, under the fetcher's new token, and wakes nobody (the row is taken)."""
    token = uuid.uuid4()
    head, after = _keyed(conn, "handover", token, "0 s")
    listener = _listening(dsn)
    try:
        claimer = asyncio.run(_handover(dsn, "handover", head, token))
        assert [[msg.id for msg in msgs] for msgs in claimer.taken] == [[after]]
        assert _woken(dsn, listener) == []
    finally:
        listener.close()
    assert conn.execute(
        "SELECT id, acquired_token, deliveries_count FROM outbox"
        " WHERE queue = 'handover' AND acquired_token IS NOT NULL"
    ).fetchall() == [(after, claimer.token, 1)]


def test_a_next_row_not_due_is_left_and_the_fetchers_are_woken(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """The row behind the acked one is not due: nothing is claimed, and the NOTIFY goes out
    as from a plain ack, so no fetcher sleeps through the key's next row."""
    token = uuid.uuid4()
    head, _ = _keyed(conn, "handover_later", token, "1 hour")
    listener = _listening(dsn)
    try:
        claimer = asyncio.run(_handover(dsn, "handover_later", head, token))
        assert claimer.taken == []
        assert _woken(dsn, listener) == ["handover_later"]
    finally:
        listener.close()
    assert conn.execute(
        "SELECT count(*) FROM outbox WHERE queue = 'handover_later' AND acquired_token IS NOT NULL"
    ).fetchone() == (0,)
