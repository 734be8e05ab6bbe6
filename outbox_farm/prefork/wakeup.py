"""How the arbiter sleeps and wakes: signals queued by their handlers, and a self-pipe that
ends its select as soon as one arrives.

A Python signal handler runs between two bytecodes of whatever the main loop is doing, so it
does nothing but queue the signal; the main loop handles it at a point of its choosing.
Python's wakeup fd writes a byte to the pipe for every signal, so a select already under way
returns at once instead of at its timeout.
"""

from __future__ import annotations

import os
import select
import signal
from collections.abc import Iterable


class Wakeup:
    """Installed by the arbiter in its own process; `pending` is appended to by the signal
    handlers and emptied by the arbiter's main loop (the same thread)."""

    def __init__(self, signals: Iterable[int]) -> None:
        self.pending: list[int] = []
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        for sig in signals:
            signal.signal(sig, self._queue)
        signal.set_wakeup_fd(self._write)

    def _queue(self, signum: int, frame: object) -> None:
        self.pending.append(signum)

    def wait(self, timeout: float) -> None:
        """Sleep until a signal arrives or `timeout` seconds pass."""
        try:
            readable, _, _ = select.select([self._read], [], [], timeout)
        except InterruptedError:
            return
        if readable:
            while True:
                try:
                    if not os.read(self._read, 512):
                        break
                except BlockingIOError:
                    break

    def close(self) -> None:
        """In a process the arbiter forked, which has its own signal handling: the pipe is the
        arbiter's."""
        os.close(self._read)
        os.close(self._write)
