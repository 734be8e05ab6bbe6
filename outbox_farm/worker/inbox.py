"""The inbox: claimed rows of one queue on their way from the fetcher to the executors.

Every message passes through here once, so it is the runtime's one per-message hop between
tasks. `asyncio.Queue` would do, at a dozen Python calls per item for a size bound, task
accounting and a putters' list that nothing here uses (the ledger bounds what the fetcher
claims): this is the part of it the runtime needs, a deque and the executors waiting on it.
None in the inbox is the stop's sentinel (see `Executors.stop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections import deque
from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class Empty(enum.Enum):
    """`Inbox.take()` found nothing (None is an item: the stop's sentinel)."""

    EMPTY = enum.auto()


EMPTY = Empty.EMPTY


class Inbox(Generic[T]):
    """First in, first out; `get()` waits while it is empty. On one event loop only."""

    __slots__ = ("_items", "_waiters", "_woken")

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._woken = 0  # waiters woken that have not run since

    def __len__(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def put_nowait(self, item: T) -> None:
        """Add `item`; wake a waiting `get()` unless one is woken already."""
        self._items.append(item)
        if not self._woken:
            self._wake_one()

    def put_all(self, items: Iterable[T]) -> None:
        """`put_nowait` of each of `items`, in order (a claim's rows: one wake-up, as the
        woken executor wakes the next)."""
        before = len(self._items)
        self._items.extend(items)
        if len(self._items) > before and not self._woken:
            self._wake_one()

    def take(self) -> T | Empty:
        """`get()` without waiting: the oldest item, or EMPTY. The executors' common case,
        where a coroutine per message would cost more than the rest of the hop."""
        items = self._items
        if not items:
            return EMPTY
        item = items.popleft()
        if items and not self._woken:
            self._wake_one()
        return item

    def get_nowait(self) -> T:
        """The oldest item; IndexError when there is none."""
        return self._items.popleft()

    async def get(self) -> T:
        """The oldest item, once there is one."""
        items = self._items
        while not items:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._woken -= 1  # woken, then cancelled before it ran
                else:
                    waiter.cancel()
                    with contextlib.suppress(ValueError):  # a wake-up skipped it already
                        self._waiters.remove(waiter)
                if items and not self._woken:
                    self._wake_one()  # pass the wake-up on
                raise
            self._woken -= 1
        item = self.take()
        assert item is not EMPTY  # the loop ended with an item waiting
        return item

    def _wake_one(self) -> None:
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():  # not cancelled while its task has yet to run
                waiter.set_result(None)
                self._woken += 1
                return
