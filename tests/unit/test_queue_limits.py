"""A queue's farm-wide limits reaching a runtime, over the in-memory store: set while the
runtime runs (or before it starts), they bound the handlers running at once from the next claim
on; cleared, the queue runs as wide as its concurrency again. The budget's sharing between
claimers and its rate are the store's (tests/contract/test_store_limits.py); across processes,
tests/acceptance/test_limits_farm.py."""

from __future__ import annotations

import asyncio

from outbox_farm import Farm, Message
from outbox_farm.limits import Limits, Rate
from outbox_farm.metrics import metrics
from outbox_farm.testing.memory import MemoryStore
from outbox_farm.worker.runtime import Runtime
from tests.steps import eventually


class Gate:
    """A handler that holds every row until released, counting those running at once."""

    def __init__(self) -> None:
        self.running = 0
        self.most = 0
        self.done = 0
        self.open = asyncio.Event()

    async def __call__(self, msg: Message) -> None:
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await self.open.wait()
        finally:
            self.running -= 1
            self.done += 1


def gated(concurrency: int = 8) -> tuple[Farm, Gate]:
    farm = Farm()
    gate = Gate()
    farm.handler("q", concurrency=concurrency)(gate)
    return farm, gate


def limited(runtime: Runtime, limits: Limits) -> bool:
    return runtime.fetchers["q"].limits == limits


def test_max_running_bounds_the_handlers_from_the_next_claim_on() -> None:
    farm, gate = gated()

    async def scenario() -> None:
        store = MemoryStore(farm)
        async with store.running(poll_interval=0.05, flush_interval=0.01) as runtime:
            store.limit("q", Limits(max_running=2))
            await eventually(lambda: limited(runtime, Limits(max_running=2)), "the limit")
            assert metrics().queue_limit.labels("q", "max_running")._value.get() == 2
            for n in range(20):
                store.publish({"n": n}, queue="q")
            await eventually(lambda: gate.running == 2, "two rows running")
            # The runtime has room for 8, and 18 rows are due: what keeps it at 2 is the
            # limit. Let rows through one by one; never more than 2 run at once.
            gate.open.set()
            await eventually(lambda: gate.done == 20, "every row")
            assert gate.most == 2
            gate.open.clear()
            store.limit("q", Limits())
            await eventually(lambda: limited(runtime, Limits()), "the limit cleared")
            assert metrics().queue_limit.labels("q", "max_running")._value.get() == 0
            for n in range(8):
                store.publish({"n": n}, queue="q")
            await eventually(lambda: gate.running == 8, "the queue as wide as its concurrency")
            gate.open.set()
            await store.settled()

    asyncio.run(scenario())


def test_a_runtime_started_under_a_limit_claims_within_it_from_its_first_claim() -> None:
    farm, gate = gated()

    async def scenario() -> None:
        store = MemoryStore(farm)
        store.limit("q", Limits(max_running=3))
        for n in range(12):
            store.publish({"n": n}, queue="q")
        async with store.running(poll_interval=0.05, flush_interval=0.01):
            await eventually(lambda: gate.running == 3, "three rows running")
            gate.open.set()
            await eventually(lambda: gate.done == 12, "every row")
        assert gate.most == 3

    asyncio.run(scenario())


def test_a_rate_limited_queue_waits_for_its_budget_not_for_a_poll() -> None:
    """Rows held back by the rate are claimed when the bucket refills (a tenth of a second
    here), not at the next poll (an hour): the fetcher sleeps the time the store said."""
    farm, gate = gated()
    gate.open.set()

    async def scenario() -> None:
        store = MemoryStore(farm)
        store.limit("q", Limits(Rate(20, 1.0)))  # a bucket of two tokens, one every 50 ms
        for n in range(6):
            store.publish({"n": n}, queue="q")
        async with store.running(poll_interval=3600.0, flush_interval=0.01):
            await eventually(lambda: gate.done == 6, "every row, at the rate", timeout=10)
        assert metrics().limited_claims.labels("q")._value.get() >= 2

    asyncio.run(scenario())
