"""Handlers that misbehave and options that are wrong, against a real Postgres (DESIGN.md §6):
exceptions of every kind, hangs, undecodable bodies, broken retry strategies, refused
registrations, and counters and health that tell the truth meanwhile.

Same conventions as test_delivery.py: each test runs `Farm.running()` on its own event loop
over the per-test database, and waits on conditions with deadline-bounded polling.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool

from outbox_farm import (
    ConfigurationError,
    ConstantBackoff,
    Farm,
    Message,
    NoRetry,
    Retry,
)
from outbox_farm.chores import gauges
from outbox_farm.outcome import Kind, Outcome, Reason
from outbox_farm.problems import Problems
from tests.integration.delivery_kit import DLQ, POLL, database, falsy, qname, records, sample, zero
from tests.samples import claims
from tests.steps import eventually, publish

# -- §6: bad input and faults ----------------------------------------------------------------


@pytest.mark.parametrize(
    "kind",
    [KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError],
    ids=lambda k: k.__name__,
)
@pytest.mark.parametrize("style", ["async", "sync"])
def test_a_base_exception_from_a_handler_is_retried_then_dead_lettered_and_the_worker_goes_on(
    dsn: str, conn: psycopg.Connection, kind: type[BaseException], style: str
) -> None:
    """Not only `Exception`: a handler that raises KeyboardInterrupt, SystemExit,
    GeneratorExit or a CancelledError of its own (no one cancelled it) fails like any other,
    and the worker keeps every other row it holds running."""
    q = qname("base")
    farm = Farm(dlq_table=DLQ)
    [poison] = publish(conn, ["poison"], queue=q)
    fine = publish(conn, [f"fine-{n}" for n in range(3)], queue=q)
    runs: list[bytes] = []

    def body(msg: Message) -> None:
        runs.append(msg.body)
        if msg.body == b"poison":
            raise kind("from the handler")

    async def handle_async(msg: Message) -> None:
        body(msg)

    options: dict[str, Any] = {
        "concurrency": 1,
        "retry": ConstantBackoff(delay=0.05, max_attempts=2),
    }
    farm.handler(q, **options)(handle_async if style == "async" else body)

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            rows = await eventually(lambda: db.dlq_rows(q), "the poison row's DLQ row")
            [later] = publish(conn, ["later"], queue=q)
            await eventually(lambda: zero(db.outbox_count(q)), "every other row's ack")
            ((original, reason, exception, *_),) = rows
            assert (original, reason) == (poison, "retry_terminal")
            assert exception.startswith(repr(kind("from the handler")))
            assert later not in fine

    asyncio.run(scenario())
    assert runs.count(b"poison") == 2
    assert sorted(r for r in runs if r != b"poison") == [b"fine-0", b"fine-1", b"fine-2", b"later"]


def test_undecodable_body_reaches_the_handler_raw_and_json_failure_is_an_ordinary_error(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("raw")
    farm = Farm(dlq_table=DLQ)
    body = b"\xff\xfe not json"
    [row_id] = publish(conn, [body], queue=q)
    seen: list[tuple[bytes, int, str]] = []
    retried = sample("retried", queue=q)

    @farm.handler(q, retry=ConstantBackoff(delay=0.05, max_attempts=2))
    async def handle(msg: Message) -> None:
        try:
            msg.json()
        except Exception as exc:
            seen.append((msg.body, msg.attempts_count, type(exc).__name__))
            raise
        seen.append((msg.body, msg.attempts_count, "decoded?!"))

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(lambda: db.dlq_rows(q), "the DLQ row")

    asyncio.run(scenario())
    assert seen == [(body, 0, "JSONDecodeError"), (body, 1, "JSONDecodeError")]
    assert sample("retried", queue=q) == retried + 1  # first failure: an ordinary retry
    (row,) = conn.execute(
        "SELECT original_id, payload, failure_reason, last_exception FROM outbox_dlq"
    ).fetchall()
    assert row[:3] == (row_id, body, "retry_terminal")
    assert "JSONDecodeError" in row[3]


def test_rows_of_a_queue_without_handler_are_left_alone(dsn: str, conn: psycopg.Connection) -> None:
    q, other = qname("known"), qname("unknown")
    farm = Farm(dlq_table=DLQ)
    [orphan] = publish(conn, ["nobody's"], queue=other)
    stored = conn.execute("SELECT * FROM outbox WHERE id = %s", (orphan,)).fetchone()
    handled: list[int] = []

    @farm.handler(q)
    async def handle(msg: Message) -> None:
        handled.append(msg.id)

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            publish(conn, ["mine"], queue=q)
            await eventually(lambda: zero(db.outbox_count(q)), "the known queue's row")
            # Ten more claims (counted, not assumed from a sleep): the orphan must stay untouched.
            polls = claims(q)
            await eventually(lambda: claims(q) >= polls + 10, "ten more claims", timeout=30)

    asyncio.run(scenario())
    assert len(handled) == 1
    assert conn.execute("SELECT * FROM outbox WHERE id = %s", (orphan,)).fetchone() == stored
    assert conn.execute("SELECT count(*) FROM outbox_dlq").fetchone() == (0,)


def test_hanging_async_handler_is_abandoned_at_its_timeout(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("hang")
    farm = Farm(dlq_table=DLQ)
    [row_id] = publish(conn, ["x"], queue=q)
    cancelled: list[int] = []

    @farm.handler(q, timeout=0.2, retry=NoRetry())
    async def handle(msg: Message) -> None:
        try:
            await asyncio.sleep(60)  # past its timeout, which cancels it
        except asyncio.CancelledError:
            cancelled.append(msg.id)
            raise

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            started = time.monotonic()
            rows = await eventually(lambda: db.dlq_rows(q), "the DLQ row")
            assert time.monotonic() - started < 2.0
            assert not await db.exists(row_id)
            ((original, reason, exception, *_),) = rows
            assert (original, reason) == (row_id, "retry_terminal")
            assert exception.startswith("HandlerTimeout(")
            assert "0.2s" in exception

    asyncio.run(scenario())
    assert cancelled == [row_id]


def test_hanging_sync_handler_is_abandoned_at_its_timeout_and_retried(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("synchang")
    farm = Farm(dlq_table=DLQ)
    [row_id] = publish(conn, ["x"], queue=q)
    unblock = threading.Event()
    calls: list[int] = []

    @farm.handler(q, concurrency=2, timeout=0.2, retry=ConstantBackoff(delay=0.05))
    def handle(msg: Message) -> None:
        calls.append(msg.attempts_count)
        if msg.attempts_count == 0:
            unblock.wait(5)  # hangs past its timeout; the thread cannot be killed

    async def scenario() -> None:
        try:
            async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
                await eventually(lambda: falsy(db.exists(row_id)), "the retried run's ack")
        finally:
            unblock.set()

    asyncio.run(scenario())
    assert calls == [0, 1]


def test_a_hung_sync_handler_does_not_fail_other_messages_it_never_ran(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("starve")
    farm = Farm(dlq_table=DLQ)
    [hung] = publish(conn, ["hang"], queue=q)
    unblock = threading.Event()
    ran: list[bytes] = []

    @farm.handler(q, concurrency=1, timeout=0.2, retry=NoRetry())
    def handle(msg: Message) -> None:
        ran.append(msg.body)
        if msg.body == b"hang":
            unblock.wait(5)

    async def scenario() -> None:
        try:
            async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
                await eventually(lambda: db.dlq_rows(q), "the hung row's DLQ row")
                [fine] = publish(conn, ["fine"], queue=q)
                await eventually(lambda: falsy(db.exists(fine)), "the next row to be done")
                dlq = [(r[0], r[1]) for r in await db.dlq_rows(q)]
                assert dlq == [(hung, "retry_terminal")], "a row was failed that never ran"
                assert ran == [b"hang", b"fine"]
        finally:
            unblock.set()

    asyncio.run(scenario())


class _Raises:
    def next_delay(self, attempt: int, exc: BaseException, elapsed: float) -> float | None:
        raise RuntimeError("strategy bug")


class _Returns:
    def __init__(self, value: Any) -> None:
        self.value = value

    def next_delay(self, attempt: int, exc: BaseException, elapsed: float) -> Any:
        return self.value


@pytest.mark.parametrize(
    "strategy",
    [_Raises(), _Returns(math.nan), _Returns(-1.0), _Returns(math.inf), _Returns("soon")],
    ids=["raises", "nan", "negative", "inf", "not-a-number"],
)
def test_broken_retry_strategy_makes_the_failure_terminal_and_the_worker_goes_on(
    dsn: str, conn: psycopg.Connection, caplog: pytest.LogCaptureFixture, strategy: Any
) -> None:
    q = qname("strat")
    farm = Farm(dlq_table=DLQ)
    [failing] = publish(conn, ["fail"], queue=q)
    handled: list[bytes] = []

    @farm.handler(q, retry=strategy)
    async def handle(msg: Message) -> None:
        handled.append(msg.body)
        if msg.body == b"fail":
            raise ValueError("handler failed")

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            rows = await eventually(lambda: db.dlq_rows(q), "the DLQ row")
            assert [(r[0], r[1], r[2]) for r in rows] == [
                (failing, "retry_terminal", repr(ValueError("handler failed")))
            ]
            [later] = publish(conn, ["ok"], queue=q)
            await eventually(lambda: falsy(db.exists(later)), "the next row's ack")

    with caplog.at_level(logging.WARNING, logger="outbox_farm"):
        asyncio.run(scenario())
    assert handled == [b"fail", b"ok"]
    (record,) = records(caplog, "strategy_failed", row_id=failing)
    assert record.levelno == logging.ERROR


def test_sync_handler_runs_in_a_worker_thread(dsn: str, conn: psycopg.Connection) -> None:
    q = qname("sync")
    farm = Farm(dlq_table=DLQ)
    ids = publish(conn, [{"n": n} for n in range(5)], queue=q)
    seen: dict[int, tuple[Any, bool]] = {}
    lock = threading.Lock()

    @farm.handler(q, concurrency=4)
    def handle(msg: Message) -> None:
        with lock:
            seen[msg.id] = (msg.json(), threading.current_thread() is threading.main_thread())

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(lambda: zero(db.outbox_count(q)), "the acks")

    asyncio.run(scenario())
    assert seen == {i: ({"n": n}, False) for n, i in enumerate(ids)}


def test_raised_retry_redelivers_after_its_delay_not_at_the_next_poll(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("retryexc")
    farm = Farm(dlq_table=DLQ)
    [row_id] = publish(conn, ["x"], queue=q)
    runs: list[tuple[float, int, int]] = []

    # The default strategy would wait ~1 s: only Retry's own delay explains a ~0.3 s gap.
    @farm.handler(q)
    async def handle(msg: Message) -> None:
        runs.append((time.monotonic(), msg.deliveries_count, msg.attempts_count))
        if len(runs) == 1:
            raise Retry(delay=0.3)

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=5.0):
            await eventually(lambda: falsy(db.exists(row_id)), "the second run's ack")

    asyncio.run(scenario())
    assert [r[1:] for r in runs] == [(1, 0), (2, 1)]
    gap = runs[1][0] - runs[0][0]
    assert 0.28 <= gap < 0.75, gap


def test_retry_with_a_decimal_delay_does_not_stop_the_completer(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("retrydec")
    farm = Farm(dlq_table=DLQ)
    [first] = publish(conn, ["first"], queue=q)
    runs: list[bytes] = []

    @farm.handler(q)
    async def handle(msg: Message) -> None:
        runs.append(msg.body)
        if msg.body == b"first" and msg.attempts_count == 0:
            raise Retry(delay=Decimal("0.05"))  # type: ignore[arg-type]

    async def scenario() -> None:
        async with database(dsn) as db:
            try:
                async with farm.running(dsn, poll_interval=POLL):
                    await eventually(lambda: falsy(db.exists(first)), "the retried row's ack", 3)
                    [second] = publish(conn, ["second"], queue=q)
                    await eventually(lambda: falsy(db.exists(second)), "the next row's ack", 3)
            except TypeError as exc:  # the completer's crash, re-raised at stop
                raise AssertionError(f"the completer crashed: {exc!r}") from None

    asyncio.run(scenario())


def test_manual_ack_policy(
    dsn: str, conn: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    q = qname("manual")
    farm = Farm(dlq_table=DLQ)
    kinds = ["ack", "nack", "none", "ack-raise", "reject"]
    ids = dict(zip(kinds, publish(conn, kinds, queue=q), strict=True))
    runs: dict[bytes, list[int]] = {}

    @farm.handler(q, ack="manual", retry=ConstantBackoff(delay=0.05))
    async def handle(msg: Message) -> None:
        attempts = runs.setdefault(msg.body, [])
        attempts.append(msg.attempts_count)
        if msg.body == b"ack":
            msg.ack()
        elif msg.body in (b"nack", b"none"):
            if len(attempts) == 1:
                if msg.body == b"nack":
                    msg.nack(0.05)
                return  # "none": no decision at all, which is retried
            msg.ack()
        elif msg.body == b"ack-raise":
            msg.ack()  # the decision wins over the exception
            raise RuntimeError("after ack")
        elif msg.body == b"reject":
            msg.reject()

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(lambda: zero(db.outbox_count(q)), "every row to be done")
            assert [(r[0], r[1], r[2]) for r in await db.dlq_rows(q)] == [
                (ids["reject"], "rejected", None)
            ]

    with caplog.at_level(logging.WARNING, logger="outbox_farm"):
        asyncio.run(scenario())
    assert runs == {
        b"ack": [0],
        b"nack": [0, 1],
        b"none": [0, 1],
        b"ack-raise": [0],
        b"reject": [0],
    }
    assert any("without ack(), nack() or reject()" in r.getMessage() for r in caplog.records)


# -- §6 / configuration: refused at registration ---------------------------------------------


async def _noop(msg: Message) -> None:
    return None


class _NoNextDelay:
    def delay(self, attempt: int) -> float:
        return 1.0


@pytest.mark.parametrize(
    "options",
    [
        {"concurrency": 0},
        {"concurrency": -3},
        {"lease_ttl": math.nan},
        {"lease_ttl": 0},
        {"timeout": -1.0},
        {"timeout": math.inf},
        {"ack": "sometimes"},
        {"retry": _NoNextDelay()},
        {"max_deliveries": 0},
        {"prefetch": 0},
    ],
    ids=lambda o: "-".join(f"{k}={v!r}" for k, v in o.items()),
)
def test_bad_handler_options_are_refused_at_registration(options: dict[str, Any]) -> None:
    farm = Farm(dlq_table=DLQ)
    with pytest.raises(ConfigurationError):
        farm.handler("q", **options)(_noop)
    assert farm.handlers == {}


def test_second_handler_for_a_queue_is_refused() -> None:
    farm = Farm(dlq_table=DLQ)
    farm.handler("q")(_noop)

    async def other(msg: Message) -> None:
        return None

    with pytest.raises(ConfigurationError, match="already has a handler"):
        farm.handler("q")(other)
    assert farm.handlers["q"].func is _noop


def test_running_without_handlers_or_with_unknown_queues_is_refused() -> None:
    async def scenario(farm: Farm, **options: Any) -> None:
        async with farm.running("host=invalid.invalid dbname=never", **options):
            raise AssertionError("the runtime started")

    with pytest.raises(ConfigurationError, match="no handlers"):
        asyncio.run(scenario(Farm(dlq_table=DLQ)))
    farm = Farm(dlq_table=DLQ)
    farm.handler("q")(_noop)
    with pytest.raises(ConfigurationError, match="no handler registered"):
        asyncio.run(scenario(farm, queues=["elsewhere"]))


def test_unhashable_queue_name_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError):
        Farm(dlq_table=DLQ).handler(["q"])(_noop)  # type: ignore[arg-type]


# -- counters and health that tell the truth ------------------------------------------------


def _gauge(name: str, queue: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(f"outbox_farm_{name}", {"queue": queue, **labels})


def test_each_gauge_refreshes_on_its_own_so_a_missing_dlq_does_not_freeze_the_backlog(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("gauge")
    farm = Farm()
    problems = Problems()

    def refresh() -> None:
        async def once() -> None:
            pool = AsyncConnectionPool(dsn, kwargs={"autocommit": True}, open=False)
            async with pool:
                await gauges.refresh(pool, farm.queries, [q], problems)

        asyncio.run(once())

    for n in range(3):
        publish(conn, [n], queue=q)
    refresh()
    assert (_gauge("backlog", q), _gauge("dlq_rows", q, reason="rejected")) == (3, 0)
    assert problems.current is None

    conn.execute("DROP TABLE outbox_dlq")
    for n in range(2):
        publish(conn, [n], queue=q)
    refresh()
    assert _gauge("backlog", q) == 5  # still follows the table
    assert _gauge("dlq_rows", q, reason="rejected") == 0  # unknown: left as it was
    assert problems.current is not None
    assert problems.current.startswith("DLQ gauges: ")
    assert "outbox_dlq" in problems.current


@pytest.fixture
def stranger_dsn(dsn: str, conn: psycopg.Connection) -> Iterator[tuple[str, str]]:
    """A login role that may use the outbox but does not own it, and its name."""
    role = f"outbox_farm_worker_{uuid.uuid4().hex[:8]}"
    ident = sql.Identifier(role)
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(ident))
    try:
        conn.execute(sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON outbox TO {}").format(ident))
        yield make_conninfo(dsn, user=role), role
    finally:
        conn.execute(sql.SQL("DROP OWNED BY {}").format(ident))
        conn.execute(sql.SQL("DROP ROLE {}").format(ident))


def test_a_missing_privilege_is_the_runtimes_problem_until_it_is_granted_again(
    stranger_dsn: tuple[str, str], conn: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    worker_dsn, role = stranger_dsn
    q = qname("priv")
    farm = Farm()
    handled: list[int] = []

    @farm.handler(q)
    async def handle(msg: Message) -> None:
        handled.append(msg.id)

    grant = sql.SQL("{} UPDATE ON outbox {} {}")

    def permanent() -> list[logging.LogRecord]:
        return [r for r in records(caplog, "permanent_error") if r.levelno == logging.ERROR]

    async def scenario() -> None:
        async with farm.running(worker_dsn, poll_interval=POLL, vacuum_interval=None) as rt:
            [first] = publish(conn, ["before"], queue=q)
            await eventually(lambda: first in handled, "a delivery while all is well")

            def acked() -> bool:
                return conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)

            # Its ack too: a keyed row's ack moves its key's line up (UPDATE), so every write
            # of the runtime needs the privilege revoked below; the claim is the one watched.
            await eventually(acked, "the delivery's ack")
            assert rt.problem is None
            conn.execute(grant.format(sql.SQL("REVOKE"), sql.SQL("FROM"), sql.Identifier(role)))
            reported: list[str] = []  # every failed claim the fetcher reports, logged or not
            report = rt.problems.report

            def counted(operation: str, *args: Any, **kwargs: Any) -> bool:
                reported.append(operation)
                return report(operation, *args, **kwargs)

            rt.problems.report = counted  # type: ignore[method-assign]
            problem = await eventually(lambda: rt.problem, "the problem to be reported")
            assert problem.startswith(f"claim for queue {q}: permission denied")
            assert "\n" not in problem
            # The claim is retried several times meanwhile (counted, not assumed from a sleep).
            await eventually(lambda: len(reported) >= 5, "five failed claims", timeout=30)
            assert rt.problem == problem
            assert len(permanent()) == 1  # logged once, not once per retry
            conn.execute(grant.format(sql.SQL("GRANT"), sql.SQL("TO"), sql.Identifier(role)))
            await eventually(lambda: rt.problem is None, "the problem to clear", timeout=10)
            [later] = publish(conn, ["after"], queue=q)
            await eventually(lambda: later in handled, "a delivery once granted again")

    with caplog.at_level(logging.WARNING, logger="outbox_farm"):
        asyncio.run(scenario())
    (record,) = permanent()
    assert "permission denied" in record.getMessage()


def test_on_failure_hooks_see_every_failed_run_and_cannot_change_its_outcome(
    dsn: str, conn: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """The farm's hook serves every queue without one of its own; a queue's own hook (async
    here) replaces it. A hook that raises is logged, and the row still goes where the handler's
    failure sent it: retried, then to the DLQ."""
    q, own = qname("hook"), qname("ownhook")
    seen: list[tuple[str, int, str, Kind, Reason | None]] = []

    def farm_hook(msg: Message, exc: BaseException, outcome: Outcome) -> None:
        seen.append(("farm", msg.id, repr(exc), outcome.kind, outcome.reason))
        raise RuntimeError("the error tracker is down")

    async def own_hook(msg: Message, exc: BaseException, outcome: Outcome) -> None:
        seen.append(("own", msg.id, repr(exc), outcome.kind, outcome.reason))
        raise KeyboardInterrupt  # not even this changes the outcome

    farm = Farm(on_failure=farm_hook)
    retry = ConstantBackoff(delay=0.05, max_attempts=2)

    @farm.handler(q, retry=retry)
    async def fails(msg: Message) -> None:
        raise ValueError(f"no {msg.attempts_count}")

    @farm.handler(own, retry=retry, on_failure=own_hook)
    async def also_fails(msg: Message) -> None:
        raise ValueError(f"no {msg.attempts_count}")

    @farm.handler(qname("fine"))
    async def fine(msg: Message) -> None:
        return None

    rows = {queue: publish(conn, ["x"], queue=queue)[0] for queue in (q, own)}

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            for queue in (q, own):
                await eventually(lambda queue=queue: db.dlq_rows(queue), f"{queue}'s DLQ row")

    with caplog.at_level(logging.WARNING, logger="outbox_farm"):
        asyncio.run(scenario())
    for who, queue in (("farm", q), ("own", own)):
        assert [s[1:] for s in seen if s[0] == who] == [
            (rows[queue], repr(ValueError("no 0")), Kind.RETRY, None),
            (rows[queue], repr(ValueError("no 1")), Kind.TERMINAL, Reason.RETRY_TERMINAL),
        ]
    assert len(records(caplog, "hook_failed")) == 4
    assert farm.handlers[q].on_failure is farm_hook
    assert farm.handlers[own].on_failure is own_hook
