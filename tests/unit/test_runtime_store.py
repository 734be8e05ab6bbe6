"""`Runtime(store=...)`: the data path over a store of its own, without pools, listener, chores
or code report; the in-memory store wakes the fetchers on publish, and a retry written wakes
its queue's fetcher when it is due (the completer's back-channel), long before its poll."""

from __future__ import annotations

import asyncio

import pytest

from outbox_farm import Farm, Message
from outbox_farm.errors import ConfigurationError
from outbox_farm.testing.memory import MemoryStore
from outbox_farm.worker.runtime import Runtime
from tests.steps import eventually


def test_a_runtime_over_a_store_runs_the_data_path_alone() -> None:
    farm = Farm()
    runs: list[tuple[int, int]] = []

    @farm.handler("q", concurrency=4)
    async def handle(msg: Message) -> None:
        runs.append((msg.json()["n"], msg.deliveries_count))
        if msg.deliveries_count == 1 and msg.json()["n"] == 0:
            msg.nack(0.05)

    async def scenario() -> None:
        store = MemoryStore(farm)
        # A poll far beyond the test: only the store's wake-ups and the retry's can drive it.
        async with store.running(poll_interval=3600.0, flush_interval=0.01) as runtime:
            assert (runtime.pool, runtime.listener, runtime.code_watch) == (None, None, None)
            store.publish({"n": 0}, queue="q")
            await eventually(lambda: (0, 2) in runs, "the retried row's second run")
            await store.settled()
        assert store.rows == []

    asyncio.run(scenario())
    assert sorted(runs) == [(0, 1), (0, 2)]


def test_a_transactional_queue_cannot_run_over_a_store_of_its_own() -> None:
    farm = Farm()

    @farm.handler("plain")
    async def plain(msg: Message) -> None:
        pass

    @farm.handler("tx", transactional=True)
    async def tx(msg: Message, conn: object) -> None:
        pass

    with pytest.raises(ConfigurationError, match=r"\['tx'\] have transactional handlers"):
        Runtime(list(farm.handlers.values()), farm.queries, "", store=MemoryStore(farm))
