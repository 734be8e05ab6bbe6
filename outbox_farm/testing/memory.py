"""An outbox in memory with the Postgres store's semantics: a `storage.Store` for the runtime's
own unit tests, and for users' tests that run a farm's real runtime (fetchers, executors,
completer, heartbeats) without a database.

It is a specification as much as a double: each method says, row by row, what the statement of
`queries/runtime.sql` (or `producer.sql`) of the same name does, and `tests/contract/` runs the
same behaviour tests against both stores. What both keep: a claim counts a delivery and takes a
lease (a token and an expiry on the store's clock); expired leases are claimed again, before
due rows, unless the claimer still holds their token; every write matches id and token; rows
of one ordering key run one at a time, in id order, the oldest row left of a key blocking the
rest whether it runs, waits for a retry or is not due yet; timers are due at their time and
unique per queue and `timer_id`; a terminal row moves to the DLQ as it is deleted.

What it does not model: `FOR UPDATE SKIP LOCKED` between processes (it is one process's
table, each call atomic under a lock); the database clock (time is `clock`, wall time unless a
test passes a `ManualClock`); transactions (a publish is visible at once, and a transactional
handler, which needs one, is refused by the runtime); NOTIFY between processes (`subscribe`
serves the runtimes of this process); privileges (`refusal` never finds one missing); values
no client can load (every row comes from `publish`, so no claim marks one `invalid`); and the
`key_blocked` marks that keep Postgres's claim short along a deep key (the same rows are
claimed without them, so `free_stranded` never finds one).

The store itself locks, leases and wakes; the statements it runs are beside it: the outbox and
DLQ rows and the outcome writes in `memory_table`, the claims' choice of rows in
`memory_claims`, the producer's statements in `memory_publish`, the queues' table (pauses,
limits, breakers) in `memory_controls`, and the NOTIFY in `memory_wakeups`.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, Unpack

from ..breaker import Breaker
from ..db.claims import SET_ASIDE_TOKEN
from ..farm import Farm
from ..limits import ROOM_POLL, Limits
from ..message import Message
from ..observe import Observer
from ..producer import BatchOptions, PublishOptions
from ..settings import RuntimeSettings
from ..storage import CONTROL_PREFIX, Allowed, Claim, QueueControl, Write, Written, release
from ..worker.runtime import Runtime
from .memory_claims import busy, chosen, chosen_fair, next_times, running
from .memory_controls import Queues
from .memory_publish import cancelled, published, published_batch
from .memory_rows import DeadLetter, Row, after
from .memory_table import Tables
from .memory_wakeups import Wakeups

SETTLED_POLL = 0.005  # seconds between looks while `settled` waits


class MemoryStore:
    """The outbox of `farm` (a `Farm()` of its own when None; its producer checks and encodes
    every publish as the real one does) in memory; a `storage.Store` and a `storage.Notifier`.

    `dlq`: whether terminal rows are kept (default: whether the farm has a DLQ table). `clock`:
    the store's time in epoch seconds, what Postgres's `now()` is to the real store.
    `rows` and `dead_letters` are what a test asserts on. Safe to call from any thread.
    """

    def __init__(
        self,
        farm: Farm | None = None,
        *,
        dlq: bool | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.farm = farm = farm or Farm()
        self.clock = clock
        # The tables, written under `_lock` by whichever thread or task calls (the wake-ups
        # keep a lock of their own).
        self._lock = threading.RLock()
        self._tables = Tables(farm.names.dlq is not None if dlq is None else dlq)
        self._queues = Queues()
        self._wakeups = Wakeups()

    def now(self) -> datetime:
        return datetime.fromtimestamp(self.clock(), UTC)

    # -- publishing, as the producer's calls ---------------------------------------------

    def publish(self, body: object, **options: Unpack[PublishOptions]) -> int | None:
        """`Farm.publish` without a connection: the row's id, or None when a live timer with
        this `timer_id` was kept (`ignore`) or is running and could not be moved (`extend`)."""
        new, notify = self.farm.producer.build_row(body, **options)
        with self._lock:
            now = self.now()
            row = published(self._tables, new, now)
        if row is not None and notify and row.next_attempt_at <= now:
            self._wakeups.notify([row.queue])
        return None if row is None else row.id

    def publish_batch(self, bodies: Sequence[object], **options: Unpack[BatchOptions]) -> list[int]:
        """`Farm.publish_batch` without a connection: ids in the order of `bodies`."""
        batch, notify = self.farm.producer.build_batch(bodies, **options)
        with self._lock:
            now = self.now()
            rows, due = published_batch(self._tables, batch, now)
        if rows and notify and due <= now:
            self._wakeups.notify([batch.queue])
        return [row.id for row in rows]

    def cancel_timer(self, *, queue: str, timer_id: str) -> bool:
        """Delete a pending timer; False if there is none or its handler is running."""
        with self._lock:
            return cancelled(self._tables, queue, timer_id)

    # -- what a test reads -----------------------------------------------------------------

    @property
    def rows(self) -> list[Row]:
        """The outbox, in id order: copies, which the store's later changes leave alone."""
        with self._lock:
            return [row.snapshot() for row in self._tables.rows.values()]

    @property
    def dead_letters(self) -> list[DeadLetter]:
        """The DLQ, oldest first."""
        with self._lock:
            return list(self._tables.dead)

    # -- the wake-ups (storage.Notifier) ---------------------------------------------------

    def subscribe(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """Call `callback` with a queue whenever a row of it is published due, or a keyed row
        of it is deleted (which may free the next row of its key): when Postgres sends its
        NOTIFY. A subscriber that runs an event loop is called on that loop."""
        return self._wakeups.subscribe(callback)

    def wake(self, queues: Iterable[str] | None = None) -> None:
        """Tell the subscribers to look at `queues` (every queue with rows when None): for a
        test that moved a `ManualClock`, since nothing announces a lease that expired or a
        timer that fell due (a runtime finds those by its own clock)."""
        if queues is None:
            with self._lock:
                queues = {row.queue for row in self._tables.rows.values()}
        self._wakeups.notify(queues)

    # -- running the farm over it ------------------------------------------------------------

    def running(
        self,
        settings: RuntimeSettings | None = None,
        *,
        observers: Iterable[Observer] = (),
        **options: Any,
    ) -> AbstractAsyncContextManager[Runtime]:
        """The farm's runtime over this store until the block exits (a graceful stop):
        `Farm.running` with this store in place of a database."""
        return self.farm.running(None, settings, observers=observers, store=self, **options)

    async def settled(self, queues: Iterable[str] | None = None, timeout: float = 10.0) -> None:
        """Wait until no row of `queues` (every queue when None) is held (its handler runs, or
        its outcome is not written yet) or due now: a running runtime has done all it can
        until the clock moves. TimeoutError, naming those rows, after `timeout` seconds."""
        wanted = None if queues is None else set(queues)
        deadline = time.monotonic() + timeout
        while held := self._busy(wanted):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rows {held} still held or due after {timeout}s")
            await asyncio.sleep(SETTLED_POLL)

    def _busy(self, queues: set[str] | None) -> list[int]:
        with self._lock:
            return busy(self._tables, queues, self.now())

    # -- the operator's controls, as `outbox-farm queue pause|resume` --------------------

    def pause(self, queue: str, until: datetime | None = None, reason: str | None = None) -> None:
        """Stop every runtime on this store claiming `queue` (until `until` on `clock`, or
        until `resume`); handlers running finish."""
        with self._lock:
            self._queues.pause(queue, until, reason)
        self._wakeups.notify([CONTROL_PREFIX + queue])

    def resume(self, queue: str) -> None:
        """Let the runtimes claim `queue` again, at once."""
        with self._lock:
            self._queues.resume(queue)
        self._wakeups.notify([CONTROL_PREFIX + queue])

    def limit(self, queue: str, limits: Limits) -> None:
        """Set `queue`'s limits, shared by every runtime on this store (`Limits()`: none); a
        new rate starts with a full bucket."""
        with self._lock:
            self._queues.limit(queue, limits)
        self._wakeups.notify([CONTROL_PREFIX + queue])

    # -- the storage port (storage.Store) ------------------------------------------------

    @property
    def has_dlq(self) -> bool:
        return self._tables.dlq

    async def claim(self, claim: Claim) -> list[Message]:
        """`claim`: rows whose lease expired (soonest expired first), unless held under a
        token of `claim.held`; then due rows nobody holds, in due order (then id order); a
        keyed row only while it is the oldest row of its key left. Each is leased under
        `claim.token` for `claim.lease_ttl` seconds, its delivery counted."""
        if claim.limit is None:
            raise ValueError("a hand-over claim is sent with its ack (Flush.send)")
        with self._lock:
            now = self.now()
            rows = chosen(self._tables, claim, claim.limit, now)
            return [row.take(claim, now) for row in rows[: claim.limit]]

    async def claim_limited(self, claim: Claim) -> Allowed:
        """`claim` within the queue's limits (see `limits.allowance`): the rate's bucket
        refilled on `clock`, and `max_running` less the rows of the queue leased now (a lease
        past its expiry, or a row set aside, is not running)."""
        want = claim.limit or 0
        with self._lock:
            now, at = self.now(), self.clock()
            allowed, wait, tokens = self._queues.allowance(
                claim.queue, want, lambda: running(self._tables, claim.queue, now), at
            )
            key_max = self._queues.limits.get(claim.queue, Limits()).key_max_running
            if not allowed:
                messages = []
            elif key_max is None:
                messages = await self.claim(replace(claim, limit=allowed))
            else:
                messages = self._claim_fair(replace(claim, limit=allowed), key_max)
                if len(messages) < allowed:  # as the Postgres store: held back, ask soon
                    allowed, wait = len(messages), max(wait, ROOM_POLL)
            self._queues.spend(claim.queue, tokens, len(messages), at)
        return Allowed(messages, allowed, wait)

    def _claim_fair(self, claim: Claim, key_max: int) -> list[Message]:
        """`claim` of a queue with a per-key running limit (see `chosen_fair`)."""
        with self._lock:
            now = self.now()
            rows = chosen_fair(self._tables, claim, key_max, now)
            return [row.take(claim, now) for row in rows[: claim.limit]]

    async def breaker_failed(
        self, queue: str, breaker: Breaker, reason: str, *, down: bool
    ) -> tuple[bool, bool]:
        """As `breaker_failed`: counted under the lock, opened at the threshold or when
        `down`, the first probe `probe_every` seconds on; opening it wakes every runtime."""
        with self._lock:
            opened, is_open = self._queues.breaker_failed(queue, breaker, reason, down, self.now())
        if opened:
            self._wakeups.notify([CONTROL_PREFIX + queue])
        return opened, is_open

    async def breaker_reset(self, queue: str) -> None:
        with self._lock:
            self._queues.breaker_reset(queue)

    async def breaker_probe(self, queue: str, every: float) -> bool:
        with self._lock:
            return self._queues.breaker_probe(queue, every, self.now())

    async def breaker_close(self, queue: str) -> bool:
        with self._lock:
            closed = self._queues.breaker_close(queue)
        if closed:
            self._wakeups.notify([CONTROL_PREFIX + queue])
        return closed

    async def next_due(self, queue: str) -> float | None:
        """Seconds until the earliest due time of a row a claim could take (free, and first of
        its key) or the earliest lease expiry; None when neither exists."""
        with self._lock:
            now = self.now()
            times = next_times(self._tables, queue)
        return (min(times) - now).total_seconds() if times else None

    async def rest(self, queue: str) -> None:
        """Nothing is kept between claims here (no connections)."""

    async def free_stranded(self, queue: str) -> int:
        """Nothing is ever marked here (no `key_blocked`), so nothing is stranded."""
        return 0

    async def set_aside(self, ids: list[int], token: uuid.UUID, seconds: float) -> list[int]:
        """Park the rows still held under `token` under the nil token for `seconds`, after
        which the claim's expired branch takes them again."""
        parked = []
        with self._lock:
            now = self.now()
            for row_id in ids:
                row = self._tables.rows.get(row_id)
                if row is not None and row.acquired_token == token:
                    row.acquired_token, row.acquired_at = SET_ASIDE_TOKEN, now
                    row.lease_expires_at = after(now, seconds)
                    parked.append(row_id)
        return parked

    async def give_back(self, ids: list[int], token: uuid.UUID) -> None:
        self._write(release(ids, [token] * len(ids)), None)

    async def extend_leases(
        self, ids: list[int], tokens: list[uuid.UUID], lease_ttl: float
    ) -> set[int]:
        """Move the leases still held under their tokens to `lease_ttl` seconds from now."""
        extended = set()
        with self._lock:
            now = self.now()
            for row_id, token in zip(ids, tokens, strict=True):
                row = self._tables.rows.get(row_id)
                if row is not None and row.acquired_token == token:
                    row.lease_expires_at = after(now, lease_ttl)
                    extended.add(row_id)
        return extended

    @asynccontextmanager
    async def flush(self, *, single: bool = False) -> AsyncIterator[MemoryFlush]:
        """Each write of the flush is applied whole as it is sent; none is ever lost."""
        yield MemoryFlush(self)

    async def refusal(self, write: Write) -> None:
        """No privileges here: nothing is refused."""
        return None

    async def controls(self) -> dict[str, QueueControl]:
        """The pauses set by `pause` whose `paused_until` is not yet past on `clock`, and the
        limits set by `limit`."""
        with self._lock:
            return self._queues.controls(self.now())

    # -- the writes ------------------------------------------------------------------------

    def _write(self, write: Write, handover: Claim | None) -> Written:
        """`write` over its rows, each matched by id and token, and with an ack, the hand-over
        `handover` (`ack_next`); then the wake-ups Postgres would send at its commit."""
        with self._lock:
            written, woken = self._tables.write(write, handover, self.now())
        self._wakeups.notify(woken)
        return written


class MemoryFlush:
    """A flush on a `MemoryStore` (a `storage.Flush`)."""

    def __init__(self, store: MemoryStore) -> None:
        self._store = store

    async def send(self, write: Write, handover: Claim | None = None) -> Written:
        if handover is not None and write.kind != "ack":
            raise ValueError(f"a hand-over is sent with an ack, not with a {write.kind}")
        return self._store._write(write, handover)
