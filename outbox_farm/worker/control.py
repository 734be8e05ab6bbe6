"""The queue controls' watcher: one per runtime, it keeps the runtime's view of the operator's
controls of its queues current and tells each queue's fetcher (`Fetcher.hold`, `release`).

Controls are pauses (`Fetcher.hold`), farm-wide limits (`Fetcher.limit`: the queue's claims
then go through `Store.claim_limited`) and the state of a queue's breaker (`QueueBreaker.known`:
open, the fetcher claims only probes). It loads them once before any fetcher claims (a farm
started while a queue is paused never claims it, one started while it is limited never claims
past the limit), again at once on the NOTIFY a change sends and on every (re)connect of the
listener (NOTIFYs sent while it was down are lost), and every POLL seconds whatever happens, so
a missed NOTIFY, or a runtime without a listener, costs at most that long. A pause that ends at
its `paused_until` is reloaded at that instant, not at the next poll. A store without the
controls (a database not yet migrated) pauses nothing: said once, tried again on every poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping

from ..errors import DatabaseError, SchemaError
from ..limits import Limits
from ..metrics import metrics
from ..problems import one_line
from ..storage import QueueControl, Store
from .breaker import QueueBreaker
from .breaker import describe as describe_tripped
from .fetcher import Fetcher
from .supervised import Policy, Supervisor

log = logging.getLogger("outbox_farm.control")
POLL = 1.0  # seconds between loads when no NOTIFY comes
EXPIRY_SLACK = 0.01  # reload a hair after a pause's end, when the store finds it over
SOONEST = 0.05  # seconds at least between loads: a store's clock behind ours is no busy loop


def describe(control: QueueControl) -> str:
    """One line for logs, /healthz and the console: `queue emails paused until ... (why)`."""
    until = f" until {control.paused_until.isoformat()}" if control.paused_until else ""
    why = f" ({control.reason})" if control.reason else ""
    return f"queue {control.queue} paused{until}{why}"


class ControlWatch:
    """The controls of `fetchers`' queues, from `store`; `paused` is what this runtime sees."""

    def __init__(self, store: Store, fetchers: Mapping[str, Fetcher]) -> None:
        self.store = store
        self.fetchers = fetchers
        self.poll = POLL
        self.paused: dict[str, QueueControl] = {}
        self._changed = asyncio.Event()
        self._missing_said = False
        self._task: asyncio.Task[None] | None = None

    def changed(self) -> None:
        """The controls may have changed (a NOTIFY, a reconnect of the listener): load them."""
        self._changed.set()

    def start(self, supervisor: Supervisor) -> None:
        """After `load`. Restarted for ever if it fails: the fetchers keep the last view."""
        self._task = supervisor.spawn("queue controls' watcher", self._run, Policy.RESTART)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def load(self) -> None:
        """Read the controls and apply them to the fetchers. A store that cannot be read keeps
        the last view (a lost connection) or pauses nothing (no controls table)."""
        try:
            paused = await self.store.controls()
        except SchemaError as exc:
            if not self._missing_said:
                log.warning(
                    "no queue can be paused: the queue controls cannot be read (%s); run "
                    "`outbox-farm migrate`, the farm reads them again every %gs meanwhile",
                    one_line(exc),
                    self.poll,
                    extra={"event": "controls_missing"},
                )
                self._missing_said = True
            paused = {}
        except DatabaseError as exc:
            log.debug("queue controls not read (%s); trying again", exc)
            return
        self._apply({q: c for q, c in paused.items() if q in self.fetchers})

    def _apply(self, controls: dict[str, QueueControl]) -> None:
        paused = {queue: control for queue, control in controls.items() if control.paused}
        gauge = metrics().queue_paused
        for queue, fetcher in self.fetchers.items():
            control = paused.get(queue)
            if control is not None and self.paused.get(queue) != control:
                fetcher.hold(describe(control))
                log.info(describe(control), extra={"event": "queue_paused", "queue": queue})
            elif control is None and queue in self.paused:
                fetcher.release()
                log.info("queue %s resumed", queue, extra={"event": "queue_resumed"})
            gauge.labels(queue).set(1 if control is not None else 0)
            found = controls.get(queue)
            limits = found.limits if found is not None else Limits()
            if limits != fetcher.limits:
                self._limit(fetcher, limits)
            if fetcher.breaker is not None:
                self._breaker(fetcher, fetcher.breaker, found)
        self.paused = paused

    @staticmethod
    def _breaker(fetcher: Fetcher, breaker: QueueBreaker, found: QueueControl | None) -> None:
        tripped = found.tripped if found is not None else None
        if breaker.known(tripped, found.failures if found is not None else 0):
            queue = fetcher.spec.queue
            # What this farm does about it; the opening and the closing themselves are logged
            # once, by the process that made them (`breaker_opened`, `breaker_closed`).
            if tripped is not None:
                log.info(
                    "%s; holding it but for probes",
                    describe_tripped(queue, tripped),
                    extra={"event": "breaker_holds", "queue": queue},
                )
            else:
                log.info(
                    "queue %s breaker closed; claiming it again",
                    queue,
                    extra={"event": "breaker_releases", "queue": queue},
                )
            fetcher.wake()

    @staticmethod
    def _limit(fetcher: Fetcher, limits: Limits) -> None:
        queue = fetcher.spec.queue
        fetcher.limit(limits)
        log.info(
            "queue %s: %s, farm-wide",
            queue,
            limits,
            extra={"event": "queue_limits", "queue": queue, "limits": str(limits)},
        )
        gauge = metrics().queue_limit
        rate = limits.rate.per_second if limits.rate else 0
        gauge.labels(queue, "rate_per_second").set(rate)
        gauge.labels(queue, "max_running").set(limits.max_running or 0)

    def _wait(self) -> float:
        """Seconds until the next load: the poll, or sooner when a pause ends sooner."""
        wait = self.poll
        now = time.time()
        for control in self.paused.values():
            if control.paused_until is not None:
                left = control.paused_until.timestamp() - now + EXPIRY_SLACK
                wait = min(wait, max(left, SOONEST))
        return wait

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._wait()):
                    await self._changed.wait()
            self._changed.clear()
            await self.load()
