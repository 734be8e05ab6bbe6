"""Delivery semantics of the runtime against a real Postgres (DESIGN.md §3, §4, §6).

Each test runs `Farm.running()` on its own event loop (`asyncio.run`) over the per-test
database of the `dsn` fixture, and waits for conditions with deadline-bounded polling; a
fixed sleep is only used before asserting that something did *not* happen. Metrics are
process-global, so tests read before/after deltas on queue names of their own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import psycopg
import pytest

from outbox_farm import (
    AckPolicy,
    ConstantBackoff,
    DeadLetter,
    Farm,
    Message,
    NoRetry,
)
from outbox_farm.outcome import FRAMES_HEADER, TRUNCATED, Kind, Outcome
from outbox_farm.worker.completer import Completer
from tests.integration.delivery_kit import (
    DLQ,
    POLL,
    Row,
    count_is,
    database,
    falsy,
    qname,
    records,
    sample,
    zero,
)
from tests.steps import eventually, publish

# -- invariant 1: a row is deleted only after its handler returned ------------------------


def test_row_exists_under_its_lease_while_the_handler_runs_and_goes_after_success(
    dsn: str, conn: psycopg.Connection
) -> None:
    q, control = qname("inv1"), qname("inv1c")
    farm = Farm(dlq_table=DLQ)
    seen: list[tuple[Row | None, Row | None, Message]] = []
    ids = publish(conn, [{"n": n} for n in range(3)], queue=q)

    @farm.handler(control)
    async def handle_control(msg: Message) -> None:
        pass

    async def scenario() -> None:
        async with database(dsn) as db:

            @farm.handler(q, lease_ttl=10)
            async def handle(msg: Message) -> None:
                at_start = await db.lease(msg.id)
                # The completer writes an ack (another queue's) while this handler runs, so it
                # had the chance to write anything of this row early (counted, not a sleep).
                acked = sample("acked", queue=control)
                await farm.apublish(db.aconn, "control", queue=control)
                await eventually(lambda: sample("acked", queue=control) > acked, "a flush")
                at_end = await db.lease(msg.id)
                seen.append((at_start, at_end, msg))

            async with farm.running(dsn, poll_interval=POLL):
                await eventually(lambda: len(seen) == 3, "three handler runs")
                await eventually(lambda: zero(db.outbox_count(q)), "the acks")
            assert await db.outbox_count(q) == 0
            assert await db.dlq_rows(q) == []

    asyncio.run(scenario())
    assert sorted(m.id for _, _, m in seen) == sorted(ids)
    for at_start, at_end, msg in seen:
        for row in (at_start, at_end):
            assert row is not None, f"row {msg.id} was gone while its handler still ran"
            assert row[0] == msg.lease_token  # still held under this delivery's lease


def test_failed_handler_keeps_the_row_with_one_more_attempt_due_later_and_unleased(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("inv1f")
    farm = Farm(dlq_table=DLQ)
    calls: list[Message] = []
    [row_id] = publish(conn, [{"boom": True}], queue=q)
    retried = sample("retried", queue=q)

    @farm.handler(q, retry=ConstantBackoff(delay=30.0), lease_ttl=10)
    async def handle(msg: Message) -> None:
        calls.append(msg)
        raise ValueError("handler failed")

    async def scenario() -> None:
        async with database(dsn) as db:
            async with farm.running(dsn, poll_interval=POLL):
                await eventually(lambda: sample("retried", queue=q) == retried + 1, "the retry")
            row = await db.one(
                "SELECT attempts_count, deliveries_count, next_attempt_at > now() + interval "
                "'20 seconds', acquired_token, acquired_at, first_attempt_at IS NOT NULL, "
                "last_attempt_at IS NOT NULL FROM outbox WHERE id = %s",
                (row_id,),
            )
            assert row == (1, 1, True, None, None, True, True)
            assert await db.dlq_rows(q) == []

    asyncio.run(scenario())
    assert len(calls) == 1


# -- invariant 2: every terminal write matches id and lease token --------------------------


def test_slow_handler_loses_its_lease_the_second_runner_acks_and_the_stale_ack_is_lease_lost(
    dsn: str, conn: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    q = qname("inv2")
    farm_a, farm_b = Farm(dlq_table=DLQ), Farm(dlq_table=DLQ)
    [row_id] = publish(conn, [{"slow": True}], queue=q)
    a_calls: list[Message] = []
    b_calls: list[Message] = []
    lost = sample("lease_lost", queue=q, phase="ack")
    acked = sample("acked", queue=q)

    async def scenario() -> None:
        gate = asyncio.Event()

        @farm_a.handler(q, concurrency=1, prefetch=1, lease_ttl=0.3, timeout=5)
        async def slow(msg: Message) -> None:
            a_calls.append(msg)
            await gate.wait()  # outlives its lease; redeliveries to A queue up behind it

        @farm_b.handler(q, lease_ttl=0.3, timeout=5)
        async def fast(msg: Message) -> None:
            b_calls.append(msg)

        async with database(dsn) as db, farm_a.running(dsn, poll_interval=POLL) as runner_a:
            await eventually(lambda: a_calls, "runner A to start the handler")
            # Runner A stalls as far as its leases go (a worker cut off from the database):
            # its heartbeat stops, and the lease runs out while the handler still runs.
            await runner_a.heartbeats[0].stop()
            async with farm_b.running(dsn, poll_interval=POLL):
                await eventually(lambda: b_calls, "runner B to take the expired lease")
                await eventually(
                    lambda: falsy(db.exists(row_id)), "runner B's ack to delete the row"
                )
                gate.set()  # now A's handler returns and A acks under its stale token
                await eventually(
                    lambda: records(
                        caplog, "lease_lost", phase="ack", row_id=row_id, deliveries_count=1
                    ),
                    "A's stale ack to be reported",
                )
            assert await db.dlq_rows(q) == []

    with caplog.at_level(logging.WARNING, logger="outbox_farm"):
        asyncio.run(scenario())
    assert a_calls[0].deliveries_count == 1
    assert b_calls[0].id == row_id
    assert b_calls[0].deliveries_count >= 2
    assert b_calls[0].lease_token != a_calls[0].lease_token
    assert sample("lease_lost", queue=q, phase="ack") >= lost + 1
    assert sample("acked", queue=q) == acked + 1  # B's ack only; A's matched nothing
    (record,) = records(caplog, "lease_lost", phase="ack", row_id=row_id, deliveries_count=1)
    assert record.levelno == logging.WARNING
    assert record.queue == q  # type: ignore[attr-defined]


@pytest.mark.parametrize("phase", ["ack", "retry", "terminal"])
def test_a_write_under_a_lease_taken_over_changes_nothing(
    dsn: str, conn: psycopg.Connection, caplog: pytest.LogCaptureFixture, phase: str
) -> None:
    q = qname(f"steal_{phase}")
    farm = Farm(dlq_table=DLQ)
    [row_id] = publish(conn, [{"phase": phase}], queue=q)
    counters = {name: sample(name, queue=q) for name in ("acked", "retried")}
    terminal = sample("terminal", queue=q, reason="rejected")
    lost = sample("lease_lost", queue=q, phase=phase)

    async def scenario() -> None:
        started, proceed = asyncio.Event(), asyncio.Event()

        @farm.handler(q, lease_ttl=60, retry=ConstantBackoff(delay=0.05))
        async def handle(msg: Message) -> None:
            started.set()
            await proceed.wait()
            if phase == "retry":
                raise ValueError("try again")
            if phase == "terminal":
                raise DeadLetter("give up")

        async with database(dsn) as db:
            async with farm.running(dsn, poll_interval=POLL):
                await asyncio.wait_for(started.wait(), 4)
                # Another process re-took the row under a fresh token meanwhile.
                taken = await db.one(
                    "UPDATE outbox SET acquired_token = gen_random_uuid(), acquired_at = now() "
                    "WHERE id = %s RETURNING acquired_token, acquired_at",
                    (row_id,),
                )
                before = await db.lease(row_id)
                proceed.set()
                await eventually(
                    lambda: sample("lease_lost", queue=q, phase=phase) == lost + 1,
                    f"the {phase} write to be counted as lease_lost",
                )
            after = await db.lease(row_id)
            assert taken is not None
            assert before is not None
            assert after == before  # token, lease time, counts and due time all intact
            assert after[0] == taken[0]
            assert await db.dlq_rows(q) == []

    with caplog.at_level(logging.WARNING, logger="outbox_farm"):
        asyncio.run(scenario())
    (record,) = records(caplog, "lease_lost", row_id=row_id)
    assert record.levelno == logging.WARNING
    assert (record.phase, record.queue, record.deliveries_count) == (phase, q, 1)  # type: ignore[attr-defined]
    assert {name: sample(name, queue=q) for name in counters} == counters
    # The terminal decision is counted when it is made: terminal_total outgrows
    # dlq_written_total by exactly the lost write.
    assert sample("terminal", queue=q, reason="rejected") == terminal + (phase == "terminal")


# -- invariant 3: the DLQ ------------------------------------------------------------------


def test_no_retry_failure_is_archived_with_its_payload_headers_and_exception(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("dlq")
    farm = Farm(dlq_table=DLQ)
    [row_id] = publish(conn, [{"order": 42}], queue=q, headers={"tenant": "acme"})
    stored = conn.execute("SELECT payload, headers FROM outbox WHERE id = %s", (row_id,)).fetchone()
    error = ValueError("no stock for order 42")
    calls: list[Message] = []

    @farm.handler(q, retry=NoRetry())
    async def handle(msg: Message) -> None:
        calls.append(msg)
        raise error

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(lambda: db.dlq_rows(q), "the DLQ row")
            assert not await db.exists(row_id)

    asyncio.run(scenario())
    assert stored is not None
    rows = conn.execute(
        "SELECT original_id, queue, payload, headers, deliveries_count, failure_reason, "
        "last_exception, failed_at >= created_at FROM outbox_dlq"
    ).fetchall()
    assert [(*r[:6], r[6].splitlines()[0], r[7]) for r in rows] == [
        (row_id, q, stored[0], stored[1], 1, "retry_terminal", repr(error), True)
    ]
    assert "raise error" in rows[0][6]  # and where it was raised
    assert stored[0] == b'{"order":42}'
    assert stored[1]["tenant"] == "acme"
    assert len(calls) == 1


def _dead_letter(msg: Message) -> None:
    raise DeadLetter("poison message")


def _reject(msg: Message) -> None:
    msg.reject()


def _raise(msg: Message) -> None:
    raise KeyError("missing field")


@pytest.mark.parametrize(
    ("behaviour", "ack", "exception"),
    [
        (_dead_letter, AckPolicy.ACK_ON_SUCCESS, repr(DeadLetter("poison message"))),
        (_reject, AckPolicy.ACK_ON_SUCCESS, None),
        (_raise, "reject_on_error", repr(KeyError("missing field"))),
    ],
    ids=["DeadLetter", "msg.reject", "reject_on_error"],
)
def test_rejections_go_to_the_dlq_as_rejected_at_once(
    dsn: str,
    conn: psycopg.Connection,
    behaviour: Callable[[Message], None],
    ack: AckPolicy | str,
    exception: str | None,
) -> None:
    q = qname("rej")
    farm = Farm(dlq_table=DLQ)
    [row_id] = publish(conn, ["x"], queue=q)
    calls: list[Message] = []

    # A generous retry strategy: only the rejection can make the first failure terminal.
    @farm.handler(q, ack=ack, retry=ConstantBackoff(delay=0.05))
    async def handle(msg: Message) -> None:
        calls.append(msg)
        behaviour(msg)

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(lambda: db.dlq_rows(q), "the DLQ row")
            assert [(r[0], r[1], r[2], r[3], r[5]) for r in await db.dlq_rows(q)] == [
                (row_id, "rejected", exception, b"x", 1)
            ]
            assert not await db.exists(row_id)

    asyncio.run(scenario())
    assert len(calls) == 1


def test_row_claimed_more_than_max_deliveries_goes_to_the_dlq_unrun(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("maxd")
    farm = Farm(dlq_table=DLQ)
    [at_limit] = publish(conn, ["at-limit"], queue=q)  # this claim is delivery 3 of 3: runs
    [over] = publish(conn, ["over"], queue=q)  # this claim is delivery 4 of 3: never runs
    conn.execute("UPDATE outbox SET deliveries_count = 2 WHERE id = %s", (at_limit,))
    conn.execute("UPDATE outbox SET deliveries_count = 3 WHERE id = %s", (over,))
    ran: list[bytes] = []
    terminal = sample("terminal", queue=q, reason="max_deliveries")

    @farm.handler(q, max_deliveries=3)
    async def handle(msg: Message) -> None:
        ran.append(msg.body)

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(lambda: db.dlq_rows(q), "the DLQ row")
            await eventually(lambda: zero(db.outbox_count(q)), "both rows to leave the outbox")
            assert [(r[0], r[1], r[2], r[5]) for r in await db.dlq_rows(q)] == [
                (over, "max_deliveries", None, 4)
            ]

    asyncio.run(scenario())
    assert ran == [b"at-limit"]
    assert sample("terminal", queue=q, reason="max_deliveries") == terminal + 1


def test_successes_never_reach_the_dlq_and_terminal_and_dlq_counters_agree_per_reason(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("mix")
    farm = Farm(dlq_table=DLQ)
    kinds = ["ok"] * 6 + ["fail"] * 3 + ["dead"] * 2 + ["over"] * 1
    ids = dict(zip(publish(conn, kinds, queue=q), kinds, strict=True))
    over_ids = [i for i, k in ids.items() if k == "over"]
    conn.execute("UPDATE outbox SET deliveries_count = 5 WHERE id = ANY(%s)", (over_ids,))
    reasons = ["retry_terminal", "rejected", "max_deliveries"]
    before = {
        r: (sample("terminal", queue=q, reason=r), sample("dlq_written", queue=q, reason=r))
        for r in reasons
    }
    acked = sample("acked", queue=q)

    @farm.handler(q, max_deliveries=5, retry=NoRetry())
    async def handle(msg: Message) -> None:
        if msg.body == b"fail":
            raise RuntimeError("fail")
        if msg.body == b"dead":
            raise DeadLetter()

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(lambda: zero(db.outbox_count(q)), "every row to be done")

    asyncio.run(scenario())
    dlq: dict[int, str] = dict(
        conn.execute(
            "SELECT original_id, failure_reason FROM outbox_dlq WHERE queue = %s", (q,)
        ).fetchall()
    )
    expected = {"fail": "retry_terminal", "dead": "rejected", "over": "max_deliveries"}
    assert dlq == {i: expected[k] for i, k in ids.items() if k != "ok"}
    assert sample("acked", queue=q) == acked + 6
    for reason in reasons:
        terminal = sample("terminal", queue=q, reason=reason) - before[reason][0]
        written = sample("dlq_written", queue=q, reason=reason) - before[reason][1]
        in_table = sum(1 for r in dlq.values() if r == reason)
        assert terminal == written == in_table, reason


@pytest.mark.parametrize("fault", ["add_not_null_column", "drop_table"])
def test_failed_dlq_insert_keeps_the_row_in_the_outbox_and_says_run_check(
    dsn: str, conn: psycopg.Connection, caplog: pytest.LogCaptureFixture, fault: str
) -> None:
    q = qname("dlqfail")
    farm = Farm(dlq_table=DLQ)
    [row_id] = publish(conn, [{"doomed": True}], queue=q)
    if fault == "drop_table":
        conn.execute("DROP TABLE outbox_dlq")
    else:
        conn.execute("ALTER TABLE outbox_dlq ADD COLUMN must_have int NOT NULL")
    calls: list[Message] = []
    counts = (
        sample("terminal", queue=q, reason="rejected"),
        sample("dlq_written", queue=q, reason="rejected"),
        sample("write_failed", kind="terminal", queue=q),
    )

    def moved() -> tuple[float, float, float]:
        """Counters since the start: decided terminal, archived, failed to archive."""
        return (
            sample("terminal", queue=q, reason="rejected") - counts[0],
            sample("dlq_written", queue=q, reason="rejected") - counts[1],
            sample("write_failed", kind="terminal", queue=q) - counts[2],
        )

    @farm.handler(q, lease_ttl=0.5, timeout=0.4)
    async def handle(msg: Message) -> None:
        calls.append(msg)
        raise DeadLetter("cannot be delivered")

    def write_failures() -> list[logging.LogRecord]:
        return [
            r
            for r in records(caplog, "write_failed", phase="terminal", row_id=row_id)
            if r.levelno == logging.ERROR and "outbox-farm check" in r.getMessage()
        ]

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(write_failures, "the ERROR about the failed DLQ move")
            lease = await db.lease(row_id)
            assert lease is not None, "the row was deleted although its DLQ insert failed"
            assert lease[0] is not None  # still under a lease: delivered again when it expires
            # The decision is counted, the failed move too, and nothing claims it was archived:
            # an alert on terminal_total outgrowing dlq_written_total fires.
            terminal, written, failed = moved()
            assert terminal >= 1
            assert written == 0
            assert failed >= 1
            if fault == "add_not_null_column":
                # The operator fixes the table: the next delivery archives the row.
                await db.aconn.execute("ALTER TABLE outbox_dlq DROP COLUMN must_have")
                await eventually(lambda: db.dlq_rows(q), "the row to reach the fixed DLQ")
                assert not await db.exists(row_id)

    with caplog.at_level(logging.WARNING, logger="outbox_farm"):
        asyncio.run(scenario())
    if fault == "add_not_null_column":
        (dlq_row,) = conn.execute(
            "SELECT original_id, failure_reason, deliveries_count FROM outbox_dlq"
        ).fetchall()
        assert dlq_row[:2] == (row_id, "rejected")
        assert dlq_row[2] >= 2
        assert len(calls) >= 2
        assert moved() == (len(calls), 1, len(calls) - 1)
    else:
        still = conn.execute("SELECT count(*) FROM outbox WHERE id = %s", (row_id,)).fetchone()
        assert still == (1,)


def test_megabyte_exception_repr_is_cut_to_8192_chars_with_a_marker(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("huge")
    farm = Farm(dlq_table=DLQ)
    [row_id] = publish(conn, ["x"], queue=q)
    huge = "é" * 5_000_000

    @farm.handler(q, retry=NoRetry())
    async def handle(msg: Message) -> None:
        raise ValueError(huge)

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(lambda: db.dlq_rows(q), "the DLQ row")

    asyncio.run(scenario())
    text, chars = conn.execute(
        "SELECT last_exception, char_length(last_exception) FROM outbox_dlq WHERE original_id = %s",
        (row_id,),
    ).fetchone() or (None, None)
    assert chars == 8192
    assert text is not None
    assert len(text) == 8192
    assert text.startswith("ValueError('éé")
    cut, frames = text.split(FRAMES_HEADER)
    assert cut.endswith(TRUNCATED)
    assert "raise ValueError(huge)" in frames  # where it was raised survives the cut


def test_farm_without_dlq_deletes_terminal_rows_and_writes_no_dlq(
    dsn: str, conn: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    q = qname("nodlq")
    farm = Farm(dlq_table=None)
    ids = publish(conn, [kind for kind in ("fail", "dead", "ok")], queue=q)
    before = {
        r: (sample("terminal", queue=q, reason=r), sample("dlq_written", queue=q, reason=r))
        for r in ("retry_terminal", "rejected")
    }

    @farm.handler(q, retry=NoRetry())
    async def handle(msg: Message) -> None:
        if msg.body == b"fail":
            raise RuntimeError("fail")
        if msg.body == b"dead":
            raise DeadLetter()

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(lambda: zero(db.outbox_count(q)), "every row to be done")

    with caplog.at_level(logging.WARNING, logger="outbox_farm"):
        asyncio.run(scenario())
    (warning,) = records(caplog, "no_dlq")
    assert warning.levelno == logging.WARNING
    assert "will be deleted" in warning.getMessage()
    assert conn.execute("SELECT count(*) FROM outbox_dlq").fetchone() == (0,)
    assert conn.execute("SELECT count(*) FROM outbox WHERE id = ANY(%s)", (ids,)).fetchone() == (0,)
    for reason, (terminal, written) in before.items():
        assert sample("terminal", queue=q, reason=reason) == terminal + 1
        assert sample("dlq_written", queue=q, reason=reason) == written


def test_a_farm_keeps_failed_messages_in_outbox_dlq_unless_told_otherwise(
    dsn: str, conn: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    q = qname("defdlq")
    farm = Farm()
    assert str(farm.names.dlq) == "outbox_dlq"
    [row_id] = publish(conn, ["x"], queue=q)

    @farm.handler(q)
    async def handle(msg: Message) -> None:
        raise DeadLetter("kept")

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            rows = await eventually(lambda: db.dlq_rows(q), "the DLQ row")
            assert [(r[0], r[1]) for r in rows] == [(row_id, "rejected")]

    with caplog.at_level(logging.WARNING, logger="outbox_farm"):
        asyncio.run(scenario())
    assert records(caplog, "no_dlq") == []


# -- invariant 4: deliveries count claims, attempts count handler runs ----------------------


def test_deliveries_and_attempts_over_two_retries_then_success(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("counts")
    farm = Farm(dlq_table=DLQ)
    [row_id] = publish(conn, ["x"], queue=q)
    seen: list[tuple[int, int, Row | None]] = []

    async def scenario() -> None:
        async with database(dsn) as db:

            @farm.handler(q, retry=ConstantBackoff(delay=0.05))
            async def handle(msg: Message) -> None:
                stored = await db.one(
                    "SELECT deliveries_count, attempts_count FROM outbox WHERE id = %s",
                    (msg.id,),
                )
                seen.append((msg.deliveries_count, msg.attempts_count, stored))
                if len(seen) < 3:
                    raise RuntimeError(f"failure {len(seen)}")

            async with farm.running(dsn, poll_interval=POLL):
                await eventually(lambda: falsy(db.exists(row_id)), "the final ack")

    asyncio.run(scenario())
    assert seen == [(1, 0, (1, 0)), (2, 1, (2, 1)), (3, 2, (3, 2))]


def test_claim_of_an_expired_lease_counts_a_delivery_but_no_attempt(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("crash")
    farm = Farm(dlq_table=DLQ)
    [row_id] = publish(conn, ["x"], queue=q)
    # A process claimed the row an hour ago and died before running the handler.
    conn.execute(
        "UPDATE outbox SET deliveries_count = 1, acquired_token = gen_random_uuid(), "
        "acquired_at = now() - interval '1 hour' WHERE id = %s",
        (row_id,),
    )
    seen: list[tuple[int, int]] = []

    @farm.handler(q, lease_ttl=5)
    async def handle(msg: Message) -> None:
        seen.append((msg.deliveries_count, msg.attempts_count))

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(lambda: falsy(db.exists(row_id)), "the ack")

    asyncio.run(scenario())
    assert seen == [(2, 0)]


# -- invariant 8: one bad row does not roll back the rest of its flush ----------------------


def test_failing_dlq_move_does_not_roll_back_acks_of_the_same_flush(
    dsn: str,
    conn: psycopg.Connection,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    q = qname("iso")
    farm = Farm(dlq_table=DLQ)
    good = publish(conn, ["good" for _ in range(20)], queue=q)
    dead = publish(conn, ["dead" for _ in range(3)], queue=q)
    bad = dead[1]
    conn.execute(f"ALTER TABLE outbox_dlq ADD CONSTRAINT no_bad CHECK (original_id <> {bad})")

    batches: list[list[tuple[Kind, int]]] = []
    write = Completer.write

    async def recording_write(self: Completer, batch: list[Outcome]) -> None:
        batches.append([(o.kind, o.row_id) for o in batch])
        await write(self, batch)

    monkeypatch.setattr(Completer, "write", recording_write)

    @farm.handler(q, lease_ttl=60)
    async def handle(msg: Message) -> None:
        if msg.body == b"dead":
            raise DeadLetter()

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL, flush_interval=0.2):
            await eventually(lambda: records(caplog, "write_failed", row_id=bad), "the failure")
            await eventually(lambda: count_is(db, q, 1), "everything but the bad row to go")
            remaining = await db.lease(bad)
            assert remaining is not None
            assert remaining[0] is not None
            assert [(r[0], r[1]) for r in await db.dlq_rows(q)] == [
                (i, "rejected") for i in dead if i != bad
            ]

    with caplog.at_level(logging.WARNING, logger="outbox_farm"):
        asyncio.run(scenario())
    # The premise: the bad DLQ move and the good acks were written by one flush.
    shared = [b for b in batches if (Kind.TERMINAL, bad) in b]
    assert shared
    assert {(Kind.ACK, i) for i in good} <= set(shared[0])
    gone = conn.execute("SELECT count(*) FROM outbox WHERE id = ANY(%s)", (good,)).fetchone()
    assert gone == (0,)
