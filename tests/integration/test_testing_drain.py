"""The users' test kit against a real Postgres: `drain` runs the real runtime with a clock the
test moves, and reports every verdict; the memory recorder reaches the same verdicts."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
import pytest

from outbox_farm import (
    ConfigurationError,
    ConstantBackoff,
    DeadLetter,
    ExponentialBackoff,
    Farm,
    Message,
    Reason,
    Retry,
)
from outbox_farm.testing import DrainTimeout, Status, adrain, drain, record
from tests.steps import publish


def flaky_farm() -> Farm:
    """One queue that succeeds, fails twice then succeeds, or dead-letters, by body."""
    farm = Farm()

    @farm.handler("work", retry=ExponentialBackoff(first=1.0, factor=2.0, jitter=0.0))
    async def work(msg: Message) -> None:
        kind = msg.json()["kind"]
        if kind == "flaky" and msg.attempts_count < 2:
            raise RuntimeError(f"attempt {msg.attempts_count + 1} fails")
        if kind == "poison":
            raise DeadLetter("cannot be handled")

    return farm


def test_drain_acks_retries_and_dead_letters_moving_the_clock(dsn: str) -> None:
    farm = flaky_farm()
    publish(dsn, [{"kind": "ok"}, {"kind": "flaky"}, {"kind": "poison"}], queue="work")
    publish(dsn, [{"kind": "ok"}], queue="work", activate_in=3600)
    first = drain(farm, dsn)  # nothing moved: the flaky row's retry is not due yet
    assert sorted(first.statuses) == ["acked", "dead_lettered", "retried"]
    assert first.left == 2
    assert first.advanced == 0

    with psycopg.connect(dsn) as conn:  # what real time has left of the first retry's 1 s
        row = conn.execute(
            "SELECT extract(epoch FROM next_attempt_at - clock_timestamp())::float8 "
            "FROM outbox WHERE attempts_count = 1"
        ).fetchone()
    assert row is not None
    due_in = float(row[0])
    assert due_in <= 1.0
    began = time.monotonic()
    done = drain(farm, dsn, within=10)  # its retries after 1 s and 2 s run now
    took = time.monotonic() - began
    assert done.statuses == ["retried", "acked"]
    assert [str(r.error) for r in done.retried] == ["attempt 2 fails"]
    # The clock moved by the rest of the 1 s, then by the second retry's 2 s, less the real
    # time that passed meanwhile (bounded by the drain's own, however slow the machine is).
    assert due_in + 2.0 - took - 0.01 <= done.advanced <= due_in + 2.0 + 0.01
    assert done.left == 1  # the row due in an hour

    later = drain(farm, dsn, within=3600)
    assert later.statuses == ["acked"]
    assert later.left == 0

    poison = next(r for r in first if r.status is Status.DEAD_LETTERED)
    assert poison.reason is Reason.REJECTED
    assert isinstance(poison.error, DeadLetter)
    with psycopg.connect(dsn) as conn:
        dlq = conn.execute("SELECT failure_reason, last_exception FROM outbox_dlq").fetchall()
    assert len(dlq) == 1
    assert dlq[0][0] == "rejected"
    assert "cannot be handled" in dlq[0][1]


def test_drain_honours_max_deliveries_and_retry_delays(dsn: str) -> None:
    farm = Farm()

    @farm.handler("slow_retry", max_deliveries=3, retry=ConstantBackoff(60))
    async def always(msg: Message) -> None:
        raise Retry(delay=30)

    publish(dsn, [{"n": 1}], queue="slow_retry")
    result = drain(farm, dsn, within=120)
    assert result.statuses == ["retried", "retried", "retried", "dead_lettered"]
    assert [r.delay for r in result.retried] == [30, 30, 30]
    assert result.dead_lettered[0].reason is Reason.MAX_DELIVERIES
    assert result.dead_lettered[0].error is None  # given up on unrun


def test_drain_keeps_per_key_order_through_failures(dsn: str) -> None:
    farm = Farm()
    handled: list[int] = []

    @farm.handler("keyed", retry=ConstantBackoff(5))
    async def keyed(msg: Message) -> None:
        n = msg.json()["n"]
        if n == 0 and msg.attempts_count == 0:
            raise RuntimeError("the head fails once")
        handled.append(n)

    publish(dsn, [{"n": n} for n in range(5)], queue="keyed", ordering_key="k")
    result = drain(farm, dsn, within=5)
    assert handled == [0, 1, 2, 3, 4]
    assert result.statuses == ["retried"] + ["acked"] * 5


def test_drain_runs_transactional_handlers_in_their_transaction(dsn: str) -> None:
    farm = Farm()

    @farm.handler("billing", transactional=True)
    async def bill(msg: Message, conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute("INSERT INTO charges VALUES (%s)", (msg.json()["cents"],))
        if msg.json()["cents"] < 0:
            raise DeadLetter("negative")

    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE charges (cents int)")
    publish(dsn, [{"cents": 5}, {"cents": -1}], queue="billing")
    result = drain(farm, dsn)
    assert sorted(result.statuses) == ["acked", "dead_lettered"]
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT cents FROM charges").fetchall() == [(5,)]


def test_limit_stops_the_drain_and_leaves_the_rest(dsn: str) -> None:
    farm = Farm()

    @farm.handler("many", concurrency=1)
    async def one(msg: Message) -> None:
        pass

    publish(dsn, list(range(50)), queue="many", ordering_key="one-at-a-time")
    result = drain(farm, dsn, limit=5)
    assert 5 <= len(result) < 50
    assert result.left == 50 - len(result.acked)


def test_a_hung_handler_times_the_drain_out_with_a_reason(dsn: str) -> None:
    farm = Farm()

    @farm.handler("hangs", timeout=60)
    async def hangs(msg: Message) -> None:
        await asyncio.sleep(60)  # holds its row past the drain's timeout

    publish(dsn, [{}], queue="hangs")
    with pytest.raises(DrainTimeout, match="still held"):
        drain(farm, dsn, timeout=1)


def test_drain_refuses_bad_arguments_and_a_running_loop(dsn: str) -> None:
    farm = flaky_farm()
    with pytest.raises(ConfigurationError, match=r"no handler registered for queues \['nope'\]"):
        drain(farm, dsn, queues=["nope"])
    with pytest.raises(ConfigurationError, match="within"):
        drain(farm, dsn, within=-1)

    async def inside() -> None:
        with pytest.raises(ConfigurationError, match="await adrain"):
            drain(farm, dsn)
        publish(dsn, [{"kind": "ok"}], queue="work")
        assert (await adrain(farm, dsn)).statuses == ["acked"]

    asyncio.run(inside())


def test_the_recorder_reaches_the_verdicts_the_database_does(dsn: str) -> None:
    """The same farm and publishes, in memory and through the real runtime: the same runs."""
    farm = flaky_farm()
    bodies = [{"kind": kind} for kind in ("flaky", "ok", "poison", "ok")]
    publish(dsn, bodies, queue="work", ordering_key="k")
    real = drain(farm, dsn, within=60)
    with record(farm) as recorder:
        farm.publish_batch(None, bodies, queue="work", ordering_key="k")
        memory = recorder.run(within=60)

    def shape(runs: list[Any]) -> list[tuple[Any, ...]]:
        return [(r.message.json(), r.status, r.reason, repr(r.error), r.delay) for r in runs]

    assert shape(memory.runs) == shape(real.runs)
    assert memory.advanced == pytest.approx(3.0)
