"""A queue's paused claims, as its fetcher sees them.

While the completer finds the acks or retries of a queue's rows refused for want of a privilege,
the queue's claims are paused (see `problems`). Its fetcher then tries the refused write over no
rows, at most every PAUSED_PROBE_EVERY seconds, and claims again once it passes. Between two
probes it waits for the next one alone: a NOTIFY does not end that wait (at hundreds of
publishing transactions a second, each would cost a pool checkout and a statement), a stop does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from ..problems import Problems

PAUSED_PROBE_EVERY = 2.0  # seconds between probes of a paused queue's refused write


class Pause:
    """Whether one queue's fetcher may claim. Used by the fetcher task alone; `stop` is called
    by whoever stops the fetcher."""

    def __init__(self, queue: str, problems: Problems, logger: logging.Logger) -> None:
        self.queue = queue
        self.problems = problems
        self.log = logger
        self._probe_at = 0.0  # monotonic time of the next probe, while paused
        self._stopped = asyncio.Event()

    @property
    def paused(self) -> bool:
        """The queue's claims are paused now: `held` may wait before it says."""
        return self.queue in self.problems.paused

    def stop(self) -> None:
        """End the wait for the next probe at once (see `held`)."""
        self._stopped.set()

    async def held(self) -> bool:
        """False when the queue may be claimed: its claims are not paused, or the probe of its
        refused write just passed (they resume). True while they stay paused, once the next
        probe is due or the stop began, whichever comes first."""
        paused = self.problems.paused.get(self.queue)
        if paused is None:
            return False
        now = time.monotonic()
        if now >= self._probe_at:
            self._probe_at = now + PAUSED_PROBE_EVERY
            if await paused[1]() is None:
                self.problems.resumed(self.queue, self.log)
                return False
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._probe_at - time.monotonic()):
                await self._stopped.wait()
        return True
