"""The inbox between the fetcher and the executors: order, chained wake-ups, cancellation.

The chained wake-up is what makes it cheap, and also what could strand an item (items waiting,
executors waiting, nobody woken): every test here ends by checking that each item was taken.
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from outbox_farm.worker.inbox import EMPTY, Inbox
from tests.steps import eventually


def on_a_loop(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    @functools.wraps(test)
    def run() -> None:
        asyncio.run(asyncio.wait_for(test(), 10))  # a stranded item fails, never hangs

    return run


@on_a_loop
async def test_items_come_out_in_order_and_get_waits_for_a_put() -> None:
    inbox: Inbox[int] = Inbox()
    waiting = asyncio.ensure_future(inbox.get())
    await asyncio.sleep(0)
    assert not waiting.done()
    for i in range(3):
        inbox.put_nowait(i)
    assert await waiting == 0
    assert [await inbox.get(), inbox.get_nowait()] == [1, 2]
    assert inbox.empty()
    assert len(inbox) == 0
    with pytest.raises(IndexError):
        inbox.get_nowait()


@on_a_loop
async def test_a_handler_that_never_waits_takes_a_whole_claim_in_one_step() -> None:
    """One woken executor drains the items it finds; the next one woken finds none."""
    inbox: Inbox[int] = Inbox()
    taken: dict[int, list[int]] = {0: [], 1: []}

    async def executor(n: int) -> None:
        while (item := await inbox.get()) >= 0:
            taken[n].append(item)  # a handler that returns without suspending

    tasks = [asyncio.ensure_future(executor(n)) for n in taken]
    await asyncio.sleep(0)
    for i in range(100):
        inbox.put_nowait(i)
    await eventually(lambda: len(taken[0]) + len(taken[1]) == 100, "every item taken", 5)
    assert sorted(taken[0] + taken[1]) == list(range(100))
    assert max(len(taken[0]), len(taken[1])) == 100  # one executor took them all
    for _ in tasks:
        inbox.put_nowait(-1)
    await asyncio.gather(*tasks)


@on_a_loop
async def test_handlers_that_wait_each_start_at_once() -> None:
    """An executor that suspends in its handler has woken the next one first: every item of a
    claim is running before any handler returns."""
    inbox: Inbox[int] = Inbox()
    release = asyncio.Event()
    running: set[int] = set()

    async def executor() -> None:
        while (item := await inbox.get()) >= 0:
            running.add(item)
            await release.wait()

    tasks = [asyncio.ensure_future(executor()) for _ in range(10)]
    await asyncio.sleep(0)
    for i in range(10):
        inbox.put_nowait(i)
    await eventually(lambda: len(running) == 10, "every handler running", 5)
    assert running == set(range(10))
    release.set()
    for _ in tasks:
        inbox.put_nowait(-1)
    await asyncio.gather(*tasks)


@on_a_loop
async def test_a_woken_getter_cancelled_before_it_ran_passes_the_wake_up_on() -> None:
    inbox: Inbox[str] = Inbox()
    first = asyncio.ensure_future(inbox.get())
    second = asyncio.ensure_future(inbox.get())
    await asyncio.sleep(0)
    inbox.put_nowait("row")  # wakes `first`
    first.cancel()  # ... which is cancelled before it runs
    assert await second == "row"
    with pytest.raises(asyncio.CancelledError):
        await first


@on_a_loop
async def test_a_getter_cancelled_while_waiting_is_not_woken_later() -> None:
    inbox: Inbox[str] = Inbox()
    gone = asyncio.ensure_future(inbox.get())
    await asyncio.sleep(0)
    gone.cancel()
    inbox.put_nowait("row")  # the cancelled waiter has not run yet: it must be skipped
    waiting = asyncio.ensure_future(inbox.get())
    assert await waiting == "row"
    with pytest.raises(asyncio.CancelledError):
        await gone


@on_a_loop
async def test_random_puts_gets_and_cancellations_never_strand_an_item() -> None:
    """Executors that sometimes suspend, sometimes are cancelled (and replaced), and a
    producer putting in bursts: every item is taken exactly once."""
    rng = random.Random(7)
    inbox: Inbox[int] = Inbox()
    taken: list[int] = []

    async def executor() -> None:
        while True:
            item = await inbox.get()
            taken.append(item)
            if rng.random() < 0.5:
                await asyncio.sleep(0)

    tasks = [asyncio.ensure_future(executor()) for _ in range(8)]
    total = 0
    for _ in range(200):
        for _ in range(rng.randrange(0, 20)):
            inbox.put_nowait(total)
            total += 1
        if rng.random() < 0.3:
            victim = rng.randrange(len(tasks))
            tasks[victim].cancel()
            tasks[victim] = asyncio.ensure_future(executor())
        for _ in range(rng.randrange(0, 3)):
            await asyncio.sleep(0)
    await eventually(lambda: len(taken) == total and inbox.empty(), "every item taken", 5)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert sorted(taken) == list(range(total))


@on_a_loop
async def test_take_returns_at_once_and_strands_nothing() -> None:
    """`take()` is `get()` without the wait: EMPTY when nothing is there. Taking an item that
    a woken getter was woken for leaves the rest to it, and the wake-ups still chain."""
    inbox: Inbox[int | None] = Inbox()
    assert inbox.take() is EMPTY
    inbox.put_nowait(None)  # the stop's sentinel is an item like any other
    assert inbox.take() is None
    first = asyncio.ensure_future(inbox.get())
    second = asyncio.ensure_future(inbox.get())
    await asyncio.sleep(0)
    inbox.put_all([1, 2, 3])  # wakes `first` only
    assert inbox.take() == 1  # taken before `first` runs
    assert [await first, await second] == [2, 3]
    assert inbox.take() is EMPTY
