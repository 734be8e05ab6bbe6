"""Shutdown written once (issue 25, item 5), over the in-memory store: `Runtime.stop` stops
claiming everywhere, then drains every queue at once. No handler starts after the stop began,
in any queue; rows not yet started are released (lease cleared, their claim's delivery taken
back); running handlers finish and are acked, concurrently, so one handler's time suffices."""

from __future__ import annotations

import asyncio

from outbox_farm import Farm, Message
from outbox_farm.testing import MemoryStore
from tests.steps import eventually

PER_QUEUE = 3  # rows per queue: one running, two prefetched


def test_stop_drains_every_queue_at_once_and_starts_nothing_new() -> None:
    queues = ["slow_a", "slow_b"]
    farm = Farm()
    started: dict[str, list[int]] = {q: [] for q in queues}
    finished: dict[str, list[int]] = {q: [] for q in queues}
    stopping = False
    late: list[tuple[str, int]] = []
    gate: asyncio.Event | None = None

    for queue in queues:

        @farm.handler(queue, concurrency=1, prefetch=PER_QUEUE - 1, timeout=60)
        async def handle(msg: Message) -> None:
            if stopping:
                late.append((msg.queue, msg.id))
            started[msg.queue].append(msg.id)
            assert gate is not None
            await gate.wait()  # running still when the stop comes, on purpose
            finished[msg.queue].append(msg.id)

    store = MemoryStore(farm)
    ids = {q: store.publish_batch([b"%d" % n for n in range(PER_QUEUE)], queue=q) for q in queues}

    async def scenario() -> None:
        nonlocal gate, stopping
        gate = asyncio.Event()
        async with store.running(poll_interval=0.05, graceful_timeout=30) as rt:
            await eventually(lambda: all(started[q] for q in queues), "both handlers run")
            await eventually(
                lambda: sum(r.acquired_token is not None for r in store.rows) == 2 * PER_QUEUE,
                "every row claimed (the rest prefetched)",
            )
            stopping = True
            stop = asyncio.create_task(rt.stop())
            # One release lets both handlers finish, and the stop ends: the queues are drained
            # together, not one after another while the other queue's executor took its next row.
            await eventually(
                lambda: all(r.acquired_token is None for r in store.rows if r.id not in running()),
                "the rows not started released",
            )
            gate.set()
            await asyncio.wait_for(stop, 10)

    def running() -> set[int]:
        return {started[q][0] for q in queues if started[q]}

    asyncio.run(scenario())
    assert not late, f"handlers started after the stop began: {late}"
    assert finished == {q: [started[q][0]] for q in queues}
    unstarted = sorted(i for q in queues for i in ids[q] if i not in running())
    assert [row.id for row in store.rows] == unstarted  # the two that ran were acked
    assert all(r.acquired_token is None and r.deliveries_count == 0 for r in store.rows)
