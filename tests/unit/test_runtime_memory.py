"""The runtime's own logic, over the in-memory store (no Postgres): per-key order under
concurrency, supervision, the stop, the in-flight accounting, lease_lost, and the completer's
hand-over of a key's next row. The store keeps the Postgres store's rules (the contract suite,
`tests/contract/`, holds the two together), so what passes here is the runtime's doing."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

from outbox_farm import Farm, Message, Observer
from outbox_farm.storage import Claim, Write, Written
from outbox_farm.testing import ManualClock, MemoryStore
from outbox_farm.testing.memory import MemoryFlush
from tests.steps import eventually

LEASE = 30.0


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


def held(store: MemoryStore) -> list[int]:
    return [row.id for row in store.rows if row.acquired_token is not None]


def test_rows_of_a_key_run_one_at_a_time_in_order_beside_other_keys() -> None:
    farm = Farm()
    running: Counter[str] = Counter()
    most: Counter[str] = Counter()
    seen: dict[str, list[int]] = defaultdict(list)

    @farm.handler("q", concurrency=8)
    async def handle(msg: Message) -> None:
        key = msg.ordering_key or ""
        running[key] += 1
        most[key] = max(most[key], running[key])
        most["all"] = max(most["all"], running.total())
        for _ in range(3):  # let the other executors run meanwhile
            await asyncio.sleep(0)
        seen[key].append(int(msg.body))
        running[key] -= 1

    store = MemoryStore(farm)
    for n in range(30):
        store.publish(b"%d" % n, queue="q", ordering_key=f"k{n % 3}")

    async def scenario() -> None:
        async with store.running():
            await store.settled()

    run(scenario)
    assert seen == {f"k{k}": list(range(k, 30, 3)) for k in range(3)}
    assert [most[f"k{k}"] for k in range(3)] == [1, 1, 1]
    assert most["all"] > 1  # the keys did run side by side
    assert store.rows == []


def test_a_component_that_fails_is_restarted() -> None:
    """The fetcher's loop meets an error it does not expect: the supervisor says so and starts
    it again, and the queue's rows are delivered."""

    class FailsOnce(MemoryStore):
        failed = False

        async def next_due(self, queue: str) -> float | None:
            if not self.failed:
                self.failed = True
                raise RuntimeError("a bug in the store")
            return await super().next_due(queue)

    farm = Farm()
    handled: list[int] = []

    @farm.handler("q")
    async def handle(msg: Message) -> None:
        handled.append(msg.id)

    store = FailsOnce(farm)

    async def scenario() -> None:
        async with store.running() as runtime:
            problem = await eventually(lambda: runtime.problem, "the failure reported")
            assert "fetcher of queue q failed" in problem
            row_id = store.publish(b"x", queue="q")
            await eventually(lambda: handled, "the row handled")
            assert handled == [row_id]
            assert not runtime.fatal.is_set()

    run(scenario)


def test_the_stop_releases_unstarted_rows_and_writes_what_ran() -> None:
    farm = Farm()
    started: list[int] = []
    gate: asyncio.Event | None = None

    @farm.handler("q", concurrency=1, prefetch=3, lease_ttl=LEASE)
    async def handle(msg: Message) -> None:
        started.append(msg.id)
        assert gate is not None
        await gate.wait()

    store = MemoryStore(farm)
    first, *others = store.publish_batch([b"1", b"2", b"3", b"4"], queue="q")

    def released() -> bool:
        rows = {row.id: row for row in store.rows}
        return all(rows[i].acquired_token is None and rows[i].deliveries_count == 0 for i in others)

    async def scenario() -> None:
        nonlocal gate
        gate = asyncio.Event()
        async with store.running() as runtime:
            await eventually(lambda: started and len(held(store)) == 4, "every row claimed")
            stopping = asyncio.create_task(runtime.stop())
            await eventually(released, "the rows not started released")
            assert held(store) == [first]  # its handler still runs
            gate.set()
            await stopping
            assert runtime.fetchers["q"].ledger.rows == {}

    run(scenario)
    assert started == [first]
    assert [row.id for row in store.rows] == others  # the first one acked


def test_an_outcome_under_a_lease_taken_over_is_a_lease_lost() -> None:
    """The row's lease expires while its handler runs and another runner claims it: the ack
    matches nothing, the row stays with the new lease, and the slot is freed all the same."""

    class Lost(Observer):
        def __init__(self) -> None:
            self.lost: list[tuple[str, str, int, int | None]] = []

        def lease_lost(self, phase: str, queue: str, row_id: int, deliveries: int | None) -> None:
            self.lost.append((phase, queue, row_id, deliveries))

    farm = Farm()
    gate: asyncio.Event | None = None

    @farm.handler("q", lease_ttl=LEASE)
    async def handle(msg: Message) -> None:
        assert gate is not None
        await gate.wait()

    clock = ManualClock()
    store = MemoryStore(farm, clock=clock)
    row_id = store.publish(b"x", queue="q")
    lost = Lost()

    async def scenario() -> None:
        nonlocal gate
        gate = asyncio.Event()
        async with store.running(observers=[lost]) as runtime:
            await eventually(lambda: held(store), "the row claimed")
            clock.advance(LEASE + 1)
            other = Claim("q", 1, LEASE, uuid.uuid4(), 0.0, 0.0)
            [taken] = await store.claim(other)
            gate.set()
            await eventually(lambda: lost.lost, "the lease_lost")
            assert lost.lost == [("ack", "q", row_id, 1)]
            await eventually(lambda: not runtime.fetchers["q"].ledger.rows, "the slot freed")
            [row] = store.rows
            assert (row.id, row.acquired_token, row.deliveries_count) == (row_id, other.token, 2)
            assert taken.deliveries_count == 2

    run(scenario)


class Recording(MemoryFlush):
    """A flush that notes the rows each ack's hand-over took."""

    def __init__(self, store: MemoryStore, handed: list[int]) -> None:
        super().__init__(store)
        self.handed = handed

    async def send(self, write: Write, handover: Claim | None = None) -> Written:
        written = await super().send(write, handover)
        self.handed.extend(msg.id for msg in written.claimed)
        return written


class HandOvers(MemoryStore):
    """Records the rows each ack's hand-over took."""

    def __init__(self, farm: Farm) -> None:
        super().__init__(farm)
        self.handed: list[int] = []

    @asynccontextmanager
    async def flush(self, *, single: bool = False) -> AsyncIterator[MemoryFlush]:
        yield Recording(self, self.handed)


def test_the_next_row_of_a_key_is_handed_over_with_the_ack() -> None:
    """A process holding only a key's row writes its ack at once, and the ack claims the next
    row of the key: every row after the first arrives that way, with the poll far off."""
    farm = Farm()
    order: list[int] = []

    @farm.handler("q", concurrency=1)
    async def handle(msg: Message) -> None:
        order.append(msg.id)

    store = HandOvers(farm)
    ids = store.publish_batch([b"1", b"2", b"3", b"4", b"5"], queue="q", ordering_key="k")

    async def scenario() -> None:
        async with store.running(poll_interval=60):
            await eventually(lambda: len(order) == len(ids), "every row handled")
            await store.settled()

    run(scenario)
    assert order == ids
    assert store.handed == ids[1:]
