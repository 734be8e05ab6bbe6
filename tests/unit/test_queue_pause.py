"""An operator's pause of a queue, over the in-memory store: the runtime claims none of its
rows from the pause on (nor from its start, when the queue is paused then), the handlers
running finish and their outcomes are written, and the queue flows again on resume or when the
pause's `paused_until` passes. A paused queue is not stalled."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from outbox_farm import Farm, Message
from outbox_farm.metrics import metrics
from outbox_farm.problems import Stall
from outbox_farm.testing import ManualClock
from outbox_farm.testing.memory import MemoryStore
from outbox_farm.worker.runtime import Runtime
from tests.steps import eventually


def two_queues() -> tuple[Farm, list[str], asyncio.Event]:
    """A farm of queues `a` (its handler waits for the event returned) and `b`; the bodies
    each ran, in order."""
    farm = Farm()
    ran: list[str] = []
    go = asyncio.Event()
    go.set()

    @farm.handler("a")
    async def a(msg: Message) -> None:
        await go.wait()
        ran.append(msg.json()["s"])

    @farm.handler("b")
    async def b(msg: Message) -> None:
        ran.append(msg.json()["s"])

    return farm, ran, go


async def unclaimed_while_b_flows(store: MemoryStore, ran: list[str], body: str) -> None:
    """Publish `body` to `a` and a witness to `b`; once the witness ran, `a`'s row is still
    unclaimed (both fetchers were woken by their publishes alike)."""
    store.publish({"s": body}, queue="a")
    store.publish({"s": f"witness of {body}"}, queue="b")
    await eventually(lambda: f"witness of {body}" in ran, "the witness's run")
    await store.settled(["b"])
    assert body not in ran
    counts = [row.deliveries_count for row in store.rows if row.queue == "a"]
    assert counts
    assert set(counts) == {0}


def held(runtime: Runtime, queue: str) -> bool:
    return runtime.fetchers[queue].held_by is not None


def test_a_paused_queue_is_not_claimed_and_flows_again_on_resume() -> None:
    farm, ran, _ = two_queues()

    async def scenario() -> None:
        store = MemoryStore(farm)
        async with store.running(poll_interval=3600.0, flush_interval=0.01) as runtime:
            store.pause("a", reason="smtp down")
            await eventually(lambda: held(runtime, "a"), "the pause reaching the fetcher")
            assert list(runtime.paused) == ["a"]
            assert runtime.warnings == ["queue a paused (smtp down)"]
            assert metrics().queue_paused.labels("a")._value.get() == 1
            await unclaimed_while_b_flows(store, ran, "held")
            store.resume("a")
            await eventually(lambda: "held" in ran, "the paused row's run after the resume")
            await store.settled()
            assert (runtime.paused, runtime.warnings) == ({}, [])
            assert metrics().queue_paused.labels("a")._value.get() == 0

    asyncio.run(scenario())


def test_a_farm_started_while_a_queue_is_paused_claims_none_of_it() -> None:
    farm, ran, _ = two_queues()

    async def scenario() -> None:
        store = MemoryStore(farm)
        store.pause("a")
        store.publish({"s": "before"}, queue="a")
        async with store.running(poll_interval=0.01, flush_interval=0.01) as runtime:
            assert held(runtime, "a")
            await unclaimed_while_b_flows(store, ran, "after")
            assert "before" not in ran
            store.resume("a")
            await store.settled()
        assert sorted(ran) == ["after", "before", "witness of after"]

    asyncio.run(scenario())


def test_a_handler_running_as_its_queue_is_paused_finishes_and_its_outcome_is_written() -> None:
    farm, ran, go = two_queues()

    async def scenario() -> None:
        go.clear()
        store = MemoryStore(farm)
        async with store.running(poll_interval=3600.0, flush_interval=0.01) as runtime:
            store.publish({"s": "running"}, queue="a")
            await eventually(lambda: store.rows[0].acquired_token, "the row's claim")
            store.pause("a")
            await eventually(lambda: held(runtime, "a"), "the pause reaching the fetcher")
            go.set()
            await eventually(lambda: not store.rows, "the running row's ack")
            assert ran == ["running"]
            await unclaimed_while_b_flows(store, ran, "next")

    asyncio.run(scenario())


def test_a_pause_until_a_time_ends_then() -> None:
    farm, ran, _ = two_queues()

    async def scenario() -> None:
        clock = ManualClock()
        store = MemoryStore(farm, clock=clock)
        store.pause("a", until=store.now() + timedelta(seconds=60))
        async with store.running(poll_interval=0.01, flush_interval=0.01) as runtime:
            assert runtime.warnings[0].startswith("queue a paused until ")
            await unclaimed_while_b_flows(store, ran, "due at the end")
            clock.advance(61)
            await eventually(lambda: "due at the end" in ran, "the run once the pause ended")
            assert runtime.paused == {}

    asyncio.run(scenario())


def test_a_pause_ends_a_stall_and_starts_its_count_afresh() -> None:
    stall = Stall("a", failures=5, failing_for=30.0, overdue=60.0)
    assert not stall.idle(61.0)
    assert stall.idle(61.0)
    assert stall.paused()
    assert stall.reason is None
    assert not stall.idle(61.0)
    assert not stall.paused()
