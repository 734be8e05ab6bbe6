"""Per-key ordering, over the in-memory store: rows of one queue and key run one at a time in
id order, a failing or delayed head holds its key back until it is acked or dead-lettered, and
rows without a key, or of another key, are not held back by it. The store keeps the Postgres
store's rules (`tests/contract/`), so what passes here is the runtime's doing."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from collections.abc import Callable

from outbox_farm import ConstantBackoff, Farm, Message, Retry
from outbox_farm.testing import ManualClock, MemoryStore
from tests.steps import eventually


class Ledger:
    """What ran, in the order it started, and whether two rows of one key ever overlapped."""

    def __init__(self) -> None:
        self.acked: list[tuple[str | None, int]] = []
        self.running: dict[str, int] = {}
        self.overlaps: list[tuple[str, int, int]] = []

    def start(self, key: str | None, row_id: int) -> None:
        if key is not None:
            if key in self.running:
                self.overlaps.append((key, self.running[key], row_id))
            self.running[key] = row_id

    def finish(self, key: str | None, row_id: int, ok: bool) -> None:
        if key is not None and self.running.get(key) == row_id:
            del self.running[key]
        if ok:
            self.acked.append((key, row_id))

    def acked_by_key(self) -> dict[str | None, list[int]]:
        out: dict[str | None, list[int]] = defaultdict(list)
        for key, row_id in self.acked:
            out[key].append(row_id)
        return out


def run_until(store: MemoryStore, done: Callable[[], object], what: str) -> None:
    async def scenario() -> None:
        async with store.running(poll_interval=0.05):
            await eventually(done, what)

    asyncio.run(scenario())


def test_rows_of_one_key_run_one_at_a_time_in_publish_order_despite_failures() -> None:
    farm = Farm()
    ledger = Ledger()
    rng = random.Random(7)
    keys = [f"order-{k}" for k in range(6)]
    store = MemoryStore(farm)
    published: dict[str | None, list[int]] = defaultdict(list)
    for n in range(120):
        key = keys[n % len(keys)] if n % 5 else None
        row_id = store.publish({"n": n}, queue="q", ordering_key=key)
        assert row_id is not None
        published[key].append(row_id)
    total = sum(len(ids) for ids in published.values())

    @farm.handler("q", concurrency=16, retry=ConstantBackoff(0.01), max_deliveries=None)
    async def handle(msg: Message) -> None:
        key = msg.ordering_key
        ledger.start(key, msg.id)
        try:
            for _ in range(rng.randrange(4)):  # a random run time: overlaps would show
                await asyncio.sleep(0)
            if rng.random() < 0.3:
                raise RuntimeError("flaky")
        except RuntimeError:
            ledger.finish(key, msg.id, ok=False)
            raise
        ledger.finish(key, msg.id, ok=True)

    run_until(store, lambda: len(ledger.acked) == total, "every row acked")
    assert ledger.overlaps == []
    acked = ledger.acked_by_key()
    for key in keys:
        assert acked[key] == published[key], f"{key} ran out of order"
    assert sorted(acked[None]) == published[None]
    assert store.rows == []


def test_a_failing_head_holds_its_key_until_dead_lettered_and_others_move_on() -> None:
    farm = Farm()
    store = MemoryStore(farm)
    head = store.publish("poison", queue="q", ordering_key="k")
    after = [store.publish(f"next-{i}", queue="q", ordering_key="k") for i in range(3)]
    free = [store.publish(f"free-{i}", queue="q") for i in range(3)]
    other = store.publish("other key", queue="q", ordering_key="other")
    order: list[int] = []
    head_attempts: list[int] = []

    @farm.handler("q", concurrency=8, retry=ConstantBackoff(0.05), max_deliveries=3)
    async def handle(msg: Message) -> None:
        if msg.id == head:
            head_attempts.append(msg.attempts_count)
            raise RuntimeError("poison")
        order.append(msg.id)

    run_until(store, lambda: len(order) == 7 and not store.rows, "seven runs")
    # Rows without a key and rows of another key ran while "k" was held back by its head.
    assert set(order[:4]) == {*free, other}
    assert order[4:] == after
    assert len(head_attempts) == 3
    [dead] = store.dead_letters
    assert (dead.original_id, dead.failure_reason) == (head, "max_deliveries")


def test_a_delayed_or_retrying_head_blocks_its_key_but_not_other_keys() -> None:
    farm = Farm()
    clock = ManualClock()
    store = MemoryStore(farm, clock=clock)
    later = store.publish("later", queue="q", ordering_key="k", activate_in=60)
    behind = store.publish("behind", queue="q", ordering_key="k")
    now = store.publish("now", queue="q", ordering_key="j")
    ran: list[int] = []

    @farm.handler("q", concurrency=4)
    async def handle(msg: Message) -> None:
        ran.append(msg.id)

    async def scenario() -> None:
        async with store.running(poll_interval=0.05):
            await eventually(lambda: ran, "the free key's run")
            await store.settled()
            assert ran == [now]  # key "j" was not held back by "k"'s delayed head
            clock.advance(61)
            await eventually(lambda: len(ran) == 3, "three runs")

    asyncio.run(scenario())
    assert ran == [now, later, behind]


def test_batch_publish_keeps_the_bodies_order_per_key() -> None:
    farm = Farm()
    store = MemoryStore(farm)
    ids = store.publish_batch(list(range(10)), queue="q", ordering_key="one")
    mixed = store.publish_batch(
        ["a", "b", "c", "d"], queue="q", ordering_keys=["x", None, "x", "y"]
    )
    keys = {row.id: row.ordering_key for row in store.rows}
    assert [keys[i] for i in ids] == ["one"] * 10
    assert [keys[i] for i in mixed] == ["x", None, "x", "y"]
    seen: list[int] = []

    @farm.handler("q", concurrency=8)
    async def handle(msg: Message) -> None:
        seen.append(msg.id)

    run_until(store, lambda: len(seen) == 14, "fourteen runs")
    assert [i for i in seen if i in ids] == ids
    assert [i for i in seen if i in (mixed[0], mixed[2])] == [mixed[0], mixed[2]]


def test_a_retry_of_a_keyed_row_keeps_its_place() -> None:
    """An explicit nack with a delay does not let the next row of the key overtake it."""
    farm = Farm()
    clock = ManualClock()
    store = MemoryStore(farm, clock=clock)
    first = store.publish("first", queue="q", ordering_key="k")
    second = store.publish("second", queue="q", ordering_key="k")
    seen: list[int] = []

    @farm.handler("q", concurrency=4)
    async def handle(msg: Message) -> None:
        seen.append(msg.id)
        if msg.id == first and msg.attempts_count == 0:
            raise Retry(30)

    async def scenario() -> None:
        async with store.running(poll_interval=0.05):
            await eventually(lambda: seen, "the first run")
            await store.settled()
            assert seen == [first]  # the second row waits behind its key's retrying head
            clock.advance(31)
            await eventually(lambda: seen.count(second) == 1, "the second row's run")

    asyncio.run(scenario())
    assert seen == [first, first, second]
