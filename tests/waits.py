"""Waiting on a condition in the in-process tests, one way for all of them."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

from outbox_farm import Observer


async def eventually(check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """Poll `check` (sync, or returning an awaitable) until it returns something truthy, which
    is returned; fail at the deadline naming `what`. The deadline is generous on purpose: it
    only matters when the condition never comes, and a busy machine must not fail a test that
    would pass on an idle one."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


class Claims(Observer):
    """When each of the fetchers' claims began (monotonic), empty ones too: a test that needs a
    fetcher to have looked, and gone back to rest, waits for a claim begun after some moment
    rather than sleeping and hoping it did."""

    def __init__(self) -> None:
        self.begun: list[float] = []

    def claimed(self, queue: str, rows: int, seconds: float) -> None:
        self.begun.append(time.monotonic() - seconds)

    def since(self, moment: float) -> int:
        """How many claims began at or after `moment` and have ended."""
        return sum(begun >= moment for begun in self.begun)
