"""A queue's breaker, over the in-memory store: failures in a row open it (or one
`DownstreamDown` at once); open, the queue holds, the rows claimed already go back with their
attempts and deliveries as they were, and one probe runs each interval; a probe's success
closes it and the backlog flows. A `DeadLetter` is the row's fault and does not count."""

from __future__ import annotations

import asyncio
import logging

import pytest

from outbox_farm import Breaker, DeadLetter, DownstreamDown, Farm, Message
from outbox_farm.metrics import metrics
from outbox_farm.testing.memory import MemoryStore
from outbox_farm.worker.runtime import Runtime
from tests.steps import eventually


class Downstream:
    """What the handler calls: down (raising `error`) until `up()`; counts the calls."""

    def __init__(self, error: type[Exception] = ConnectionError) -> None:
        self.error = error
        self.is_up = False
        self.failed = 0
        self.sent: list[int] = []

    def up(self) -> None:
        self.is_up = True

    async def __call__(self, msg: Message) -> None:
        await asyncio.sleep(0)
        if not self.is_up:
            self.failed += 1
            raise self.error(f"connection refused sending {msg.id}")
        self.sent.append(msg.id)


def farm_of(downstream: Downstream, breaker: Breaker, concurrency: int = 8) -> Farm:
    farm = Farm()
    farm.handler("q", concurrency=concurrency, breaker=breaker)(downstream)
    return farm


def is_open(runtime: Runtime) -> bool:
    breaker = runtime.fetchers["q"].breaker
    return breaker is not None and breaker.tripped is not None


def attempts(store: MemoryStore) -> int:
    return sum(row.attempts_count for row in store.rows)


def leased(store: MemoryStore) -> int:
    return sum(1 for row in store.rows if row.acquired_token is not None)


def probes(caplog: pytest.LogCaptureFixture) -> int:
    return sum(1 for r in caplog.records if getattr(r, "event", None) == "breaker_probe")


def test_failures_in_a_row_open_it_and_an_outage_spends_no_more_attempts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "outbox_farm")
    downstream = Downstream()
    farm = farm_of(downstream, Breaker(failures=3, probe_every=0.3))

    async def scenario() -> None:
        store = MemoryStore(farm)
        for n in range(200):
            store.publish({"n": n}, queue="q")
        async with store.running(poll_interval=0.05, flush_interval=0.01) as runtime:
            await eventually(lambda: is_open(runtime), "the breaker open")
            assert any("breaker open" in line for line in runtime.warnings)
            assert metrics().breaker_open.labels("q")._value.get() == 1
            # Open for three probes' time at least: the backlog is not walked to the DLQ.
            await eventually(lambda: probes(caplog) >= 3, "three probes")
            # The rows claimed before it opened are back (a probe may be out).
            await eventually(lambda: leased(store) <= 1, "the rows claimed before it opened back")
            assert store.dead_letters == []
            assert attempts(store) <= 3 + probes(caplog)
            deliveries = sum(row.deliveries_count for row in store.rows)
            assert deliveries <= 3 + probes(caplog)  # the rows sent back unrun took theirs back
            downstream.up()
            await eventually(lambda: len(downstream.sent) == 200, "the backlog, after recovery")
            assert not is_open(runtime)
            assert metrics().breaker_open.labels("q")._value.get() == 0
        assert store.dead_letters == []

    asyncio.run(scenario())


def test_one_downstream_down_opens_it_at_once() -> None:
    downstream = Downstream(DownstreamDown)
    farm = farm_of(downstream, Breaker(failures=100, probe_every=3600), concurrency=1)

    async def scenario() -> None:
        store = MemoryStore(farm)
        for n in range(20):
            store.publish({"n": n}, queue="q")
        async with store.running(poll_interval=0.05, flush_interval=0.01) as runtime:
            await eventually(lambda: is_open(runtime), "the breaker open")
            await eventually(lambda: leased(store) == 0, "the rows claimed before it opened back")
            assert downstream.failed == 1
            assert attempts(store) == 1

    asyncio.run(scenario())


def test_a_dead_letter_is_the_rows_fault_and_opens_nothing() -> None:
    farm = Farm(dlq_table="outbox_dlq")

    @farm.handler("q", concurrency=1, breaker=Breaker(failures=2, probe_every=3600))
    async def reject(msg: Message) -> None:
        raise DeadLetter("malformed")

    async def scenario() -> None:
        store = MemoryStore(farm)
        for n in range(10):
            store.publish({"n": n}, queue="q")
        async with store.running(poll_interval=0.05, flush_interval=0.01) as runtime:
            await eventually(lambda: len(store.dead_letters) == 10, "every row rejected")
            assert not is_open(runtime)

    asyncio.run(scenario())


def test_successes_between_failures_keep_it_closed() -> None:
    calls = [0]
    farm = Farm()

    @farm.handler("q", concurrency=1, breaker=Breaker(failures=3, probe_every=3600))
    async def flaky(msg: Message) -> None:
        calls[0] += 1
        if calls[0] % 2:
            raise ConnectionError("every other call")

    async def scenario() -> None:
        store = MemoryStore(farm)
        for n in range(20):
            store.publish({"n": n}, queue="q")
        async with store.running(poll_interval=0.05, flush_interval=0.01) as runtime:
            await eventually(lambda: calls[0] >= 20, "twenty calls")
            assert not is_open(runtime)

    asyncio.run(scenario())


def test_a_probe_dead_lettered_unrun_leaves_the_next_probe_free() -> None:
    """A probe row past its max_deliveries goes to the DLQ without a run: the breaker probes
    with the next row, and the queue flows once the downstream is back."""
    downstream = Downstream()
    farm = Farm(dlq_table="outbox_dlq")
    farm.handler("q", concurrency=1, max_deliveries=2, breaker=Breaker(1, 0.05))(downstream)

    async def scenario() -> None:
        store = MemoryStore(farm)
        store.publish({"n": 0}, queue="q")
        async with store.running(poll_interval=0.05, flush_interval=0.01) as runtime:
            await eventually(lambda: len(store.dead_letters) == 1, "the first row's dead letter")
            assert is_open(runtime)
            store.publish({"n": 1}, queue="q")
            downstream.up()
            await eventually(lambda: len(downstream.sent) == 1, "the next row, probed")
            await eventually(lambda: not is_open(runtime), "the breaker closed")

    asyncio.run(scenario())
