"""Supervised tasks (issue 25, item 4): every long-running loop of the runtime is watched.

Each test injects an unexpected exception into one loop's step (monkeypatched), on a real
database, and checks that the failure is logged with its traceback, the runtime reports the
component while it restarts, and the component comes back (rows keep being delivered, the step
runs again). A data-path component that keeps failing makes the worker fatally broken
(`Runtime.fatal`); a chore that keeps failing never does. Built-in observers are guarded like
users' ones.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest

from outbox_farm import Farm, Message
from outbox_farm.chores import gauges, retention, vacuum
from outbox_farm.db.store import PostgresStore
from outbox_farm.observe.prometheus import Tally
from outbox_farm.worker import listener
from outbox_farm.worker.completer import Completer
from outbox_farm.worker.executor import Executors
from outbox_farm.worker.fetcher import Fetcher
from outbox_farm.worker.inflight import Ledger
from outbox_farm.worker.runtime import Runtime
from tests.steps import Claims, eventually

POLL = 0.05


class Injected(RuntimeError):
    """The failure a test injects."""


class Fault:
    """Wraps `original` so its first `times` calls raise `Injected` (every call: None)."""

    def __init__(self, original: Callable[..., Any], times: int | None = 1) -> None:
        self.original = original
        self.times = times
        self.calls = 0

    def raising(self) -> bool:
        self.calls += 1
        return self.times is None or self.calls <= self.times

    def sync(self) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.raising():
                raise Injected(f"injected failure {self.calls}")
            return self.original(*args, **kwargs)

        return call

    def coroutine(self) -> Callable[..., Awaitable[Any]]:
        async def call(*args: Any, **kwargs: Any) -> Any:
            if self.raising():
                raise Injected(f"injected failure {self.calls}")
            return await self.original(*args, **kwargs)

        return call

    def patch(self, monkeypatch: pytest.MonkeyPatch, target: Any, name: str) -> Fault:
        wrapper = self.coroutine() if inspect.iscoroutinefunction(self.original) else self.sync()
        monkeypatch.setattr(target, name, wrapper)
        return self


def qname(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def failures(caplog: pytest.LogCaptureFixture, component: str) -> list[logging.LogRecord]:
    """The supervisor's records of `component` failing, each with its traceback."""
    return [
        r
        for r in caplog.records
        if r.name == "outbox_farm.supervised"
        and getattr(r, "component", "").startswith(component)
        and r.exc_info is not None
        and r.exc_info[0] is Injected
    ]


async def remaining(aconn: psycopg.AsyncConnection[Any], queue: str) -> int:
    cursor = await aconn.execute("SELECT count(*) FROM outbox WHERE queue = %s", (queue,))
    row = await cursor.fetchone()
    assert row is not None
    return int(row[0])


async def delivered_after_one_failure(
    dsn: str,
    caplog: pytest.LogCaptureFixture,
    component: str,
    *,
    rows: int = 6,
    lease_ttl: float = 60.0,
    back: Callable[[], bool] = lambda: True,
    **options: Any,
) -> tuple[Runtime, dict[int, int]]:
    """Run a farm whose `component` fails once (patched by the caller); publish `rows` rows
    once the failure was logged and check the runtime named the component meanwhile, that
    every row is delivered and acked, and that the component is `back`. The rows handled, by
    id, with their deliveries."""
    caplog.set_level(logging.INFO)
    queue = qname("sup")
    farm = Farm(dlq_table="outbox_dlq")
    handled: dict[int, int] = {}

    @farm.handler(queue, concurrency=2, lease_ttl=lease_ttl)
    async def handle(msg: Message) -> None:
        handled[msg.id] = msg.deliveries_count

    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
        early = [await farm.apublish(aconn, {"n": n}, queue=queue) for n in range(rows)]
        async with farm.running(dsn, poll_interval=POLL, **options) as rt:
            await eventually(lambda: failures(caplog, component), f"{component} to fail")
            problem = rt.problem
            assert problem is not None
            assert component in problem, problem
            late = [await farm.apublish(aconn, {"n": n}, queue=queue) for n in range(rows)]
            await eventually(
                lambda: all(i in handled for i in early + late), "every row handled", 30.0
            )
            await eventually(lambda: _zero(aconn, queue), "every row acked")
            await eventually(back, f"{component} back")
            assert not rt.fatal.is_set()
            assert rt.fatal_reason is None
    return rt, handled


async def _zero(aconn: psycopg.AsyncConnection[Any], queue: str) -> bool:
    return await remaining(aconn, queue) == 0


# -- the data path: restarted ------------------------------------------------------------------


def test_a_fetcher_that_fails_once_is_restarted(
    dsn: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    fault = Fault(Fetcher._next_wait).patch(monkeypatch, Fetcher, "_next_wait")
    back = lambda: fault.calls > 1  # noqa: E731
    asyncio.run(delivered_after_one_failure(dsn, caplog, "fetcher of queue", back=back))
    record = failures(caplog, "fetcher of queue")[0]
    assert record.levelno == logging.ERROR
    assert "restarting it" in record.getMessage()


def test_an_executor_that_fails_once_is_restarted_and_its_row_comes_back_counted(
    dsn: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The row in the failed executor's hand is let go unwritten: it comes back when its lease
    ends, with its delivery counted (a row that keeps breaking an executor reaches
    max_deliveries)."""
    Fault(Ledger.start).patch(monkeypatch, Ledger, "start")
    _, handled = asyncio.run(
        delivered_after_one_failure(dsn, caplog, "executor", lease_ttl=2.0, graceful_timeout=5)
    )
    assert sorted(handled.values())[-1] == 2  # the abandoned row, on its second delivery
    assert any(getattr(r, "event", None) == "rows_abandoned" for r in caplog.records)


def test_a_completer_that_fails_once_is_restarted(
    dsn: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    Fault(Completer._collect).patch(monkeypatch, Completer, "_collect")
    asyncio.run(delivered_after_one_failure(dsn, caplog, "completer"))


def test_a_timeout_watchdog_that_fails_once_is_restarted(
    dsn: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    fault = Fault(Executors._watch).patch(monkeypatch, Executors, "_watch")
    back = lambda: fault.calls == 2  # noqa: E731
    asyncio.run(delivered_after_one_failure(dsn, caplog, "timeout watchdog of queue", back=back))


def test_a_lease_heartbeat_that_fails_once_is_restarted_and_keeps_the_lease(
    dsn: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handler runs for three leases; the heartbeat's first beat fails, the restarted one
    keeps extending: the row is acked on its first delivery, never taken over."""
    caplog.set_level(logging.INFO)
    fault = Fault(PostgresStore.extend_leases).patch(monkeypatch, PostgresStore, "extend_leases")
    queue = qname("beat")
    farm = Farm(dlq_table="outbox_dlq")
    deliveries: list[int] = []

    @farm.handler(queue, lease_ttl=1.5, timeout=20)
    async def handle(msg: Message) -> None:
        deliveries.append(msg.deliveries_count)
        # Held until the restarted heartbeat has beaten twice and the row has outlived three
        # leases on the database clock: without those beats it would have been claimed again.
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:

            async def outlived() -> bool:
                cursor = await conn.execute(
                    "SELECT clock_timestamp() > acquired_at + interval '4.5 s' FROM outbox "
                    "WHERE id = %s",
                    (msg.id,),
                )
                row = await cursor.fetchone()
                return fault.calls >= 3 and row is not None and row[0]

            await eventually(outlived, "two beats after the restart, three leases long")

    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
            await farm.apublish(aconn, {}, queue=queue)
            async with farm.running(dsn, poll_interval=POLL) as rt:
                await eventually(lambda: failures(caplog, "lease heartbeat"), "a failed beat")
                assert "lease heartbeat of queue" in (rt.problem or "")
                await eventually(lambda: _zero(aconn, queue), "the row acked", 30.0)
                assert not rt.fatal.is_set()
        assert deliveries == [1]

    asyncio.run(scenario())


def signalling_farm(queue: str) -> tuple[Farm, asyncio.Event]:
    """A farm (with a DLQ) whose handler of `queue` sets the event it returns."""
    farm = Farm(dlq_table="outbox_dlq")
    handled = asyncio.Event()

    @farm.handler(queue)
    async def handle(msg: Message) -> None:
        handled.set()

    return farm, handled


def test_a_listener_that_fails_once_is_restarted(
    dsn: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a poll of 30 s only the restarted listener's NOTIFY can deliver the row soon."""
    caplog.set_level(logging.INFO)
    Fault(listener.listen).patch(monkeypatch, listener, "listen")  # type: ignore[attr-defined]
    queue = qname("listen")
    farm, handled = signalling_farm(queue)
    claims = Claims()

    async def scenario() -> None:
        async with (
            await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn,
            farm.running(dsn, poll_interval=30.0, observers=[claims]) as rt,
        ):
            await eventually(lambda: failures(caplog, "listener"), "the listener to fail")
            assert rt.listener is not None
            await asyncio.wait_for(rt.listener.connected.wait(), 20)
            # Past the fetcher's wake-up at the connect: its first claim, then the one the
            # restarted listener's connect woke (the failed one never connected).
            await eventually(lambda: len(claims.begun) >= 2, "the claim the connect woke")
            await farm.apublish(aconn, {}, queue=queue)
            await asyncio.wait_for(handled.wait(), 10)

    asyncio.run(scenario())


# -- the chores: restarted for ever ------------------------------------------------------------


@pytest.mark.parametrize(
    ("component", "module", "step", "options"),
    [
        ("gauges", gauges, "refresh", {"gauges_interval": 0.05}),
        ("vacuum", vacuum, "vacuum_once", {"vacuum_interval": 0.05}),
        ("DLQ retention", retention, "expire_once", {"dlq_retention": 3600.0}),
    ],
)
def test_a_chore_that_fails_once_is_restarted(
    dsn: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    component: str,
    module: Any,
    step: str,
    options: dict[str, Any],
) -> None:
    fault = Fault(getattr(module, step)).patch(monkeypatch, module, step)
    back = lambda: fault.calls >= 2  # noqa: E731
    asyncio.run(delivered_after_one_failure(dsn, caplog, component, rows=2, back=back, **options))


def test_a_chore_that_always_fails_is_reported_but_never_fatal(
    dsn: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More failures than make a data-path component fatal: the worker still delivers."""
    caplog.set_level(logging.INFO)
    Fault(gauges.refresh, times=None).patch(monkeypatch, gauges, "refresh")
    queue = qname("chore")
    farm, handled = signalling_farm(queue)

    async def scenario() -> None:
        async with (
            await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn,
            farm.running(dsn, poll_interval=POLL, gauges_interval=0.05) as rt,
        ):
            await eventually(lambda: len(failures(caplog, "gauges")) >= 6, "six failures")
            assert not rt.fatal.is_set()
            assert "gauges failed and is restarting" in (rt.problem or "")
            await farm.apublish(aconn, {}, queue=queue)
            await asyncio.wait_for(handled.wait(), 20)

    asyncio.run(scenario())


# -- persistent failure of the data path: fatal ------------------------------------------------


@pytest.mark.parametrize(
    ("component", "target", "step"),
    [
        ("fetcher of queue", Fetcher, "_next_wait"),
        ("executor", Ledger, "start"),
    ],
)
def test_a_data_path_component_that_keeps_failing_makes_the_worker_fatally_broken(
    dsn: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    component: str,
    target: Any,
    step: str,
) -> None:
    caplog.set_level(logging.INFO)
    Fault(getattr(target, step), times=None).patch(monkeypatch, target, step)
    queue = qname("fatal")
    farm = Farm(dlq_table="outbox_dlq")

    @farm.handler(queue, concurrency=1)
    async def handle(msg: Message) -> None:
        pass

    async def scenario() -> None:
        async with (
            await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn,
            farm.running(dsn, poll_interval=POLL, graceful_timeout=2) as rt,
        ):
            for n in range(8):
                await farm.apublish(aconn, {"n": n}, queue=queue)
            await asyncio.wait_for(rt.fatal.wait(), 30)
            assert rt.fatal_reason is not None
            assert rt.fatal_reason.startswith(component), rt.fatal_reason
            assert "failed 5 times" in rt.fatal_reason
            assert (rt.problem or "").startswith("worker broken: ")
        assert len(failures(caplog, component)) >= 5
        broken = [r for r in caplog.records if getattr(r, "event", None) == "worker_broken"]
        assert len(broken) == 1
        assert broken[0].exc_info is not None

    asyncio.run(scenario())


# -- observers ---------------------------------------------------------------------------------


def test_a_failing_built_in_observer_is_logged_and_kills_no_executor(
    dsn: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO)

    # Inside the observer's per-message work (which that observer guards itself): adding a
    # value to a tally fails.
    class Failing(list[float]):
        def append(self, value: float) -> None:
            raise Injected("injected failure")

    tally_init = Tally.__init__

    def failing_init(self: Tally, child: Any) -> None:
        tally_init(self, child)
        self.values = Failing()

    monkeypatch.setattr(Tally, "__init__", failing_init)
    queue = qname("obs")
    farm = Farm(dlq_table="outbox_dlq")
    handled: set[int] = set()

    @farm.handler(queue, concurrency=2)
    async def handle(msg: Message) -> None:
        handled.add(msg.id)

    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
            ids = {await farm.apublish(aconn, {"n": n}, queue=queue) for n in range(10)}
            async with farm.running(dsn, poll_interval=POLL) as rt:
                await eventually(lambda: handled >= ids, "every row handled")
                await eventually(lambda: _zero(aconn, queue), "every row acked")
                assert rt.problem is None
        failed = [r for r in caplog.records if getattr(r, "event", None) == "observer_failed"]
        # Once per event it failed on (the lag and the run time both go through a tally).
        assert sorted(r.getMessage().split(" failed on ")[1].split(";")[0] for r in failed) == [
            "handler_finished",
            "handler_started",
        ]
        assert all(r.exc_info is not None for r in failed)
        assert not [r for r in caplog.records if r.name == "outbox_farm.supervised"]

    asyncio.run(scenario())
