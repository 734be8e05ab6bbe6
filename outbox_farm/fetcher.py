"""The fetcher: one per queue, claims rows into the executors' inbox.

It never holds more rows than the queue's capacity (executors plus prefetch), claims again at
once when a claim came back full, and otherwise sleeps until the first of: a NOTIFY for its
queue, the next due time it knows of (delayed rows, retries, expiring leases, so those fire on
time), or a jittered poll interval that keeps processes from running in step.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable

from .backoff import Backoff
from .db import claims
from .db.pool import Pool
from .errors import DatabaseError
from .handler import HandlerSpec
from .inflight import Ledger
from .leases import lease_token
from .message import Message
from .observe import Observer
from .problems import Problems
from .queries import Queries

log = logging.getLogger("outbox_farm.fetcher")
DUE_SLACK = 0.001  # wake a hair late rather than early: an early claim finds nothing


class Fetcher:
    """Claims for one queue, and owns the queue's in-flight ledger (`ledger`): a row counts
    against the capacity from its claim until the completer settles it."""

    def __init__(
        self,
        spec: HandlerSpec,
        pool: Pool,
        queries: Queries,
        inbox: asyncio.Queue[Message | None],
        observer: Observer,
        *,
        poll_interval: float = 0.5,
        worker_id: int | None = None,
        problems: Problems | None = None,
        on_starved: Callable[[], None] = lambda: None,
    ) -> None:
        self.spec = spec
        self.pool = pool
        self.queries = queries
        self.inbox = inbox
        self.observer = observer
        self.poll_interval = poll_interval
        self.worker_id = worker_id
        self.problems = problems or Problems()
        self.on_starved = on_starved
        self.operation = f"claim for queue {spec.queue}"
        self.capacity = spec.capacity
        self.ledger = Ledger(spec.queue, self.capacity, observer)
        # Claim in halves of the capacity: one half is handled while the other half's outcomes
        # are written, so claims and writes overlap; and claim only when a half fits, unless
        # nothing is in flight at all.
        self.batch = max(1, self.capacity // 2)
        self._wake = asyncio.Event()
        self._due_at: float | None = None  # monotonic time of the earliest known due row
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    # -- called by other components ------------------------------------------------------

    def wake(self) -> None:
        """Something may be claimable now (NOTIFY, listener reconnect)."""
        self._wake.set()

    def note_due(self, delay: float) -> None:
        """A row of this queue becomes due in `delay` seconds (a retry just written)."""
        due = time.monotonic() + delay
        if self._due_at is None or due < self._due_at:
            self._due_at = due
            self._wake.set()  # re-arm the sleep with the earlier deadline

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"outbox-farm-fetch-{self.spec.queue}")

    async def stop(self) -> None:
        """Stop claiming. A claim already sent is allowed to finish so its rows are known."""
        self._stopping = True
        self._wake.set()
        self.ledger.slots.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    @property
    def alive(self) -> bool:
        """Its loop runs: started, not stopped, not ended by an error it did not expect."""
        return self._task is not None and not self._task.done()

    # -- the loop ------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = Backoff()
        ledger = self.ledger
        while not self._stopping:
            free = ledger.free
            if free < self.batch and len(ledger):
                ledger.slots.clear()
                self.on_starved()  # slots free up when outcomes are written: write them now
                await ledger.slots.wait()
                continue
            self._wake.clear()
            want = min(free, self.batch)
            try:
                got = await self._claim(want)
                self.problems.solved(self.operation)
                if got == want:
                    backoff.reset()
                    continue  # more may be waiting: claim again at once
                wait = await self._next_wait()
                backoff.reset()
            except DatabaseError as exc:
                wait = backoff.next()
                if not self.problems.report(self.operation, exc, log):
                    log.warning(
                        "claim for queue %s failed (%s); retrying in %.2fs",
                        self.spec.queue,
                        exc,
                        wait,
                        extra={
                            "event": "db_reconnect",
                            "component": "fetcher",
                            "queue": self.spec.queue,
                        },
                    )
            if self._stopping:
                return
            try:
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def _claim(self, limit: int) -> int:
        started = time.perf_counter()
        spec = self.spec
        # The lease runs from the claim's now() on the database, which is after this moment:
        # a deadline counted from here errs on the early side.
        sent = time.monotonic()
        token = lease_token(self.worker_id)
        rows = await claims.claim(
            self.pool,
            self.queries,
            queue=spec.queue,
            limit=limit,
            lease_ttl=spec.lease_ttl,
            token=token,
            held=self.ledger.held(),
        )
        received = time.monotonic()
        self.observer.claimed(spec.queue, len(rows), time.perf_counter() - started)
        if not rows:
            return 0
        self.ledger.hold((row[0] for row in rows), token)
        start_by = sent + spec.lease_ttl - spec.start_margin
        queue = spec.queue
        claimed_at = rows[0][9]  # one statement: one now() for every row
        claimed_epoch = claimed_at.timestamp()
        put = self.inbox.put_nowait
        for (
            row_id,
            payload,
            headers,
            deliveries,
            attempts,
            created,
            due,
            first,
            timer,
            _,
            key,
        ) in rows:
            put(
                Message(
                    row_id,
                    queue,
                    payload,
                    headers or {},
                    deliveries,
                    attempts,
                    created,
                    due,
                    first,
                    timer,
                    token,
                    claimed_at,
                    key,
                    received_monotonic=received,
                    start_by=start_by,
                    claimed_epoch=claimed_epoch,
                    due_epoch=due.timestamp(),
                )
            )
        return len(rows)

    async def _next_wait(self) -> float:
        """Seconds to sleep: the poll interval, or less when something is due sooner."""
        wait = self.poll_interval * random.uniform(0.9, 1.1)
        due = await claims.next_due(self.pool, self.queries, self.spec.queue)
        if due is not None:
            wait = min(wait, max(due, 0.0) + DUE_SLACK)
        if self._due_at is not None:
            local = self._due_at - time.monotonic()
            if local <= 0:
                self._due_at = None
            wait = min(wait, max(local, 0.0) + DUE_SLACK)
        return wait
