"""A limit on log lines that repeat: a queue whose handler keeps failing retries every row it
holds, and a line per retry of the same error tells an operator nothing after the first few.

At most `burst` lines of one kind pass in a window of `window` seconds, a kind being a queue, an
event and a cause: the error's one-line summary with its varying parts (numbers, hex ids) masked,
so that "order 41 not found" and "order 42 not found" are one cause. The lines held back are
counted, and one report gives the count when the window closes (a timer on the event loop), at
the latest when the next line of that kind passes or when the runtime stops.

Memory is bounded: at most `KEYS` windows are kept, the windows that ended are dropped first,
and a kind that finds no room is not limited (so many different causes at once are all logged:
they are not repeats). Owned by the event loop: the observer calls it there, as does its timer.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

KEYS = 1024
_VARYING = re.compile(r"[0-9A-Fa-f]*[0-9][0-9A-Fa-f]*")

Kind = tuple[str, str, str]  # queue, event, cause
# A window closed with lines held back: its kind, how many, and over how many seconds.
Report = Callable[[Kind, int, float], None]


def cause(text: str) -> str:
    """`text` with its numbers and hex ids masked (`#`): what stays the same across rows."""
    return _VARYING.sub("#", text)


@dataclass(slots=True)
class _Window:
    started: float
    ends: float
    passed: int = 1
    held: int = 0
    timer: asyncio.TimerHandle | None = None


class RepeatLimit:
    def __init__(
        self,
        burst: int,
        window: float,
        report: Report,
        keys: int = KEYS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.burst, self.window, self.keys = burst, window, keys
        self._report, self._clock = report, clock
        # In order of opening (a window that ends is removed, its kind's next one added last),
        # so the windows that ended first are at the front.
        self._windows: dict[Kind, _Window] = {}

    def admit(self, queue: str, event: str, text: str) -> bool:
        """Whether a line of this queue and event about `text` is to be logged; one that is
        not is counted for its window's report."""
        kind = (queue, event, cause(text))
        now = self._clock()
        window = self._windows.get(kind)
        if window is not None and now < window.ends:
            if window.passed < self.burst:
                window.passed += 1
                return True
            window.held += 1
            if window.timer is None:
                window.timer = self._later(window.ends - now, kind, window)
            return False
        if window is not None:
            self._close(kind, window, now)
        elif len(self._windows) >= self.keys:
            self._drop_ended(now)
            if len(self._windows) >= self.keys:
                return True
        self._windows[kind] = _Window(now, now + self.window)
        return True

    def close(self) -> None:
        """Report every window with lines held back, and forget them all (the runtime stops)."""
        now = self._clock()
        for kind, window in list(self._windows.items()):
            self._close(kind, window, now)

    def _later(self, delay: float, kind: Kind, window: _Window) -> asyncio.TimerHandle | None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # off a loop: the kind's next line, or close(), reports it
            return None
        return loop.call_later(delay, self._ended, kind, window)

    def _ended(self, kind: Kind, window: _Window) -> None:
        if self._windows.get(kind) is window:
            self._close(kind, window, self._clock())

    def _close(self, kind: Kind, window: _Window, now: float) -> None:
        del self._windows[kind]
        if window.timer is not None:
            window.timer.cancel()
        if window.held:
            self._report(kind, window.held, now - window.started)

    def _drop_ended(self, now: float) -> None:
        while self._windows:
            kind, window = next(iter(self._windows.items()))
            if window.ends > now:
                return
            self._close(kind, window, now)
