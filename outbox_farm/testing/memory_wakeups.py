"""The NOTIFY of a `memory.MemoryStore`: who listens, and how a wake-up reaches each listener on
the event loop it runs.

Its own module because carrying a wake-up across threads and loops has nothing to do with the
rows: the store says which queues, when Postgres would send its NOTIFY (at the commit of the
change), and this calls every subscriber, on its own loop when it runs one.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterable

Subscriber = tuple[Callable[[str], None], asyncio.AbstractEventLoop | None]


class Wakeups:
    """The subscribers of one store (`storage.Notifier`). Safe to call from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subscribers: list[Subscriber] = []

    def subscribe(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """Add `callback`, to be called on the loop running here, if any; the function that
        takes it off again."""
        entry: Subscriber = (callback, _running_loop())
        with self._lock:
            self._subscribers.append(entry)

        def unsubscribe() -> None:
            with self._lock, contextlib.suppress(ValueError):
                self._subscribers.remove(entry)

        return unsubscribe

    def notify(self, queues: Iterable[str]) -> None:
        """Call every subscriber with each of `queues`, once each: at once on its own loop (or
        when it has none), through its loop from any other thread or loop; a subscriber whose
        loop is closed is passed by. Called outside the store's lock, so a callback may call
        the store."""
        with self._lock:
            subscribers = list(self._subscribers)
        for queue in dict.fromkeys(queues):
            for callback, loop in subscribers:
                if loop is None or loop is _running_loop():
                    callback(queue)
                else:
                    with contextlib.suppress(RuntimeError):  # that loop is closed
                        loop.call_soon_threadsafe(callback, queue)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
