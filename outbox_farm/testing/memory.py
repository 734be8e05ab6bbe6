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
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Unpack

import orjson

from ..breaker import Breaker
from ..db.claims import SET_ASIDE_TOKEN
from ..db.publish import Due, NewRow
from ..farm import Farm
from ..limits import ROOM_POLL, Limits, allowance
from ..message import Message
from ..observe import Observer
from ..producer import BatchOptions, PublishOptions
from ..settings import RuntimeSettings
from ..storage import (
    CONTROL_PREFIX,
    Allowed,
    Claim,
    QueueControl,
    Tripped,
    Write,
    Written,
    release,
)
from ..worker.runtime import Runtime
from .memory_rows import DeadLetter, Row, after, check_due
from .memory_table import Heads, Tables, claim_order, due_order, fair_order, first_of_key, pending

Subscriber = tuple[Callable[[str], None], asyncio.AbstractEventLoop | None]
SETTLED_POLL = 0.005  # seconds between looks while `settled` waits
FAR_FUTURE = datetime.max.replace(tzinfo=UTC)  # a due time past anything the table admits


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
        # Both written under `_lock`, by whichever thread or task calls.
        self._lock = threading.RLock()
        self._tables = Tables(farm.names.dlq is not None if dlq is None else dlq)
        self._subscribers: list[Subscriber] = []
        self._paused: dict[str, QueueControl] = {}
        self._limits: dict[str, Limits] = {}
        self._buckets: dict[str, tuple[float, float]] = {}  # queue: tokens left, when (clock)
        self._breakers: dict[str, _BreakerRow] = {}

    def now(self) -> datetime:
        return datetime.fromtimestamp(self.clock(), UTC)

    # -- publishing, as the producer's calls ---------------------------------------------

    def publish(self, body: object, **options: Unpack[PublishOptions]) -> int | None:
        """`Farm.publish` without a connection: the row's id, or None when a live timer with
        this `timer_id` was kept (`ignore`) or is running and could not be moved (`extend`)."""
        new, notify = self.farm.producer.build_row(body, **options)
        with self._lock:
            now = self.now()
            row = self._publish(new, now)
        if row is not None and notify and row.next_attempt_at <= now:
            self._notify([row.queue])
        return None if row is None else row.id

    def publish_batch(self, bodies: Sequence[object], **options: Unpack[BatchOptions]) -> list[int]:
        """`Farm.publish_batch` without a connection: ids in the order of `bodies`."""
        batch, notify = self.farm.producer.build_batch(bodies, **options)
        keys = batch.ordering_keys or [None] * len(batch.payloads)
        with self._lock:
            now = self.now()
            due = self._due(batch.due, now)
            rows = [
                self._tables.add(
                    NewRow(
                        batch.queue,
                        payload,
                        headers,
                        batch.due,
                        ordering_key=key,
                        priority=batch.priority,
                        fair_key=batch.fair_key,
                    ),
                    due,
                    now,
                )
                for payload, headers, key in zip(batch.payloads, batch.headers, keys, strict=True)
            ]
        if rows and notify and due <= now:
            self._notify([batch.queue])
        return [row.id for row in rows]

    def cancel_timer(self, *, queue: str, timer_id: str) -> bool:
        """Delete a pending timer; False if there is none or its handler is running."""
        with self._lock:
            live = self._timer(queue, timer_id)
            if live is None or live.acquired_token is not None:
                return False
            del self._tables.rows[live.id]
            return True

    def _publish(self, new: NewRow, now: datetime) -> Row | None:
        """`publish`, `publish_timer` or `publish_extend`: a live timer of the same queue and
        id wins under `ignore`; under `extend` it takes the new body, headers and due time,
        unless it is leased (a running handler's ack must not delete a newer timer)."""
        due = self._due(new.due, now)
        live = self._timer(new.queue, new.timer_id) if new.timer_id is not None else None
        if live is None:
            return self._tables.add(new, due, now)
        if not new.extend_timer or live.acquired_token is not None:
            return None
        live.payload, live.headers = new.payload, orjson.loads(new.headers)
        live.next_attempt_at = due
        if new.priority:  # an extend without a priority keeps the timer's
            live.priority = new.priority
        return live

    def _due(self, due: Due, now: datetime) -> datetime:
        """`coalesce(at, now() + delay)`, refused when the table would refuse it."""
        at = due.at.astimezone(UTC) if due.at is not None else after(now, due.delay, FAR_FUTURE)
        return check_due(at)

    def _timer(self, queue: str, timer_id: str | None) -> Row | None:
        return next(
            (r for r in self._tables.rows.values() if r.queue == queue and r.timer_id == timer_id),
            None,
        )

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
        entry: Subscriber = (callback, _running_loop())
        with self._lock:
            self._subscribers.append(entry)

        def unsubscribe() -> None:
            with self._lock, contextlib.suppress(ValueError):
                self._subscribers.remove(entry)

        return unsubscribe

    def wake(self, queues: Iterable[str] | None = None) -> None:
        """Tell the subscribers to look at `queues` (every queue with rows when None): for a
        test that moved a `ManualClock`, since nothing announces a lease that expired or a
        timer that fell due (a runtime finds those by its own clock)."""
        if queues is None:
            with self._lock:
                queues = {row.queue for row in self._tables.rows.values()}
        self._notify(queues)

    def _notify(self, queues: Iterable[str]) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for queue in dict.fromkeys(queues):
            for callback, loop in subscribers:
                if loop is None or loop is _running_loop():
                    callback(queue)
                else:
                    with contextlib.suppress(RuntimeError):  # that loop is closed
                        loop.call_soon_threadsafe(callback, queue)

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
        while busy := self._busy(wanted):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rows {busy} still held or due after {timeout}s")
            await asyncio.sleep(SETTLED_POLL)

    def _busy(self, queues: set[str] | None) -> list[int]:
        with self._lock:
            now = self.now()
            heads = self._tables.heads()
            return [
                row.id
                for row in self._tables.rows.values()
                if (queues is None or row.queue in queues)
                and (
                    row.acquired_token not in (None, SET_ASIDE_TOKEN)
                    or (pending(row, heads) and row.next_attempt_at <= now)
                )
            ]

    # -- the operator's controls, as `outbox-farm queue pause|resume` --------------------

    def pause(self, queue: str, until: datetime | None = None, reason: str | None = None) -> None:
        """Stop every runtime on this store claiming `queue` (until `until` on `clock`, or
        until `resume`); handlers running finish."""
        with self._lock:
            self._paused[queue] = QueueControl(queue, True, until, reason)
        self._notify([CONTROL_PREFIX + queue])

    def resume(self, queue: str) -> None:
        """Let the runtimes claim `queue` again, at once."""
        with self._lock:
            self._paused.pop(queue, None)
        self._notify([CONTROL_PREFIX + queue])

    def limit(self, queue: str, limits: Limits) -> None:
        """Set `queue`'s limits, shared by every runtime on this store (`Limits()`: none); a
        new rate starts with a full bucket."""
        with self._lock:
            if limits:
                if limits.rate != self._limits.get(queue, Limits()).rate:
                    self._buckets.pop(queue, None)
                self._limits[queue] = limits
            else:
                self._limits.pop(queue, None)
                self._buckets.pop(queue, None)
        self._notify([CONTROL_PREFIX + queue])

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
            heads = self._tables.heads()
            rows = [row for row in self._tables.rows.values() if row.queue == claim.queue]
            expired = _expired(rows, set(claim.held), now, heads)
            due = [row for row in rows if pending(row, heads) and row.next_attempt_at <= now]
            due.sort(key=due_order)
            chosen = expired + claim_order(due, claim.limit)
            return [row.take(claim, now) for row in chosen[: claim.limit]]

    async def claim_limited(self, claim: Claim) -> Allowed:
        """`claim` within the queue's limits (see `limits.allowance`): the rate's bucket
        refilled on `clock`, and `max_running` less the rows of the queue leased now (a lease
        past its expiry, or a row set aside, is not running)."""
        want = claim.limit or 0
        with self._lock:
            limits = self._limits.get(claim.queue, Limits())
            now = self.now()
            room = None
            if limits.max_running is not None:
                leased = sum(
                    1
                    for row in self._tables.rows.values()
                    if row.queue == claim.queue
                    and row.acquired_token not in (None, SET_ASIDE_TOKEN)
                    and row.lease_expires_at is not None
                    and row.lease_expires_at > now
                )
                room = limits.max_running - leased
            rate, tokens, at = limits.rate, None, self.clock()
            if rate is not None:
                left, then = self._buckets.get(claim.queue, (rate.burst, at))
                tokens = min(rate.burst, left + rate.per_second * max(at - then, 0.0))
            allowed, wait = allowance(
                want,
                tokens=tokens,
                per_second=rate.per_second if rate else None,
                size=rate.burst if rate else None,
                room=room,
            )
            key_max = limits.key_max_running
            if not allowed:
                messages = []
            elif key_max is None:
                messages = await self.claim(replace(claim, limit=allowed))
            else:
                messages = self._claim_fair(replace(claim, limit=allowed), key_max)
                if len(messages) < allowed:  # as the Postgres store: held back, ask soon
                    allowed, wait = len(messages), max(wait, ROOM_POLL)
            if tokens is not None:
                self._buckets[claim.queue] = (tokens - len(messages), at)
        return Allowed(messages, allowed, wait)

    def _claim_fair(self, claim: Claim, key_max: int) -> list[Message]:
        """`claim` of a queue with a per-key running limit (see `fair_order`)."""
        with self._lock:
            now = self.now()
            heads = self._tables.heads()
            rows = [row for row in self._tables.rows.values() if row.queue == claim.queue]
            expired = _expired(rows, set(claim.held), now, heads)
            leased = Counter(
                row.fair_key
                for row in rows
                if row.acquired_token not in (None, SET_ASIDE_TOKEN)  # expired ones too
            )
            due = [row for row in rows if pending(row, heads) and row.next_attempt_at <= now]
            due.sort(key=due_order)
            chosen = expired + fair_order(due, leased, key_max)
            return [row.take(claim, now) for row in chosen[: claim.limit]]

    async def breaker_failed(
        self, queue: str, breaker: Breaker, reason: str, *, down: bool
    ) -> tuple[bool, bool]:
        """As `breaker_failed`: counted under the lock, opened at the threshold or when
        `down`, the first probe `probe_every` seconds on; opening it wakes every runtime."""
        with self._lock:
            row = self._breakers.setdefault(queue, _BreakerRow())
            if row.open_since is not None:
                return False, True
            row.failures += 1
            if not down and row.failures < breaker.failures:
                return False, False
            now = self.now()
            row.open_since, row.reason = now, reason
            row.probe_at = after(now, breaker.probe_every)
        self._notify([CONTROL_PREFIX + queue])
        return True, True

    async def breaker_reset(self, queue: str) -> None:
        with self._lock:
            row = self._breakers.get(queue)
            if row is not None and row.open_since is None:
                row.failures = 0

    async def breaker_probe(self, queue: str, every: float) -> bool:
        with self._lock:
            row = self._breakers.get(queue)
            now = self.now()
            if row is None or row.open_since is None or row.probe_at is None:
                return False
            if row.probe_at > now:
                return False
            row.probe_at = after(now, every)
            return True

    async def breaker_close(self, queue: str) -> bool:
        with self._lock:
            row = self._breakers.get(queue)
            if row is None or row.open_since is None:
                return False
            self._breakers[queue] = _BreakerRow()
        self._notify([CONTROL_PREFIX + queue])
        return True

    async def next_due(self, queue: str) -> float | None:
        """Seconds until the earliest due time of a row a claim could take (free, and first of
        its key) or the earliest lease expiry; None when neither exists."""
        with self._lock:
            now = self.now()
            heads = self._tables.heads()
            rows = [row for row in self._tables.rows.values() if row.queue == queue]
            times = [row.next_attempt_at for row in rows if pending(row, heads)]
            times += [row.lease_expires_at for row in rows if row.lease_expires_at is not None]
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
            now = self.now()
            paused = {
                queue: control
                for queue, control in self._paused.items()
                if control.paused_until is None or control.paused_until > now
            }
            breakers = {
                q: row for q, row in self._breakers.items() if row.failures or row.open_since
            }
            found = {}
            for queue in sorted({*paused, *self._limits, *breakers}):
                control = paused.get(queue, QueueControl(queue, False))
                row = breakers.get(queue, _BreakerRow())
                tripped = None
                if row.open_since is not None and row.probe_at is not None:
                    probe_in = (row.probe_at - now).total_seconds()
                    tripped = Tripped(row.open_since, probe_in, row.reason)
                limits = self._limits.get(queue, Limits())
                found[queue] = replace(
                    control, limits=limits, tripped=tripped, failures=row.failures
                )
            return found

    # -- the writes ------------------------------------------------------------------------

    def _write(self, write: Write, handover: Claim | None) -> Written:
        """`write` over its rows, each matched by id and token, and with an ack, the hand-over
        `handover` (`ack_next`); then the wake-ups Postgres would send at its commit."""
        with self._lock:
            written, woken = self._tables.write(write, handover, self.now())
        self._notify(woken)
        return written


class MemoryFlush:
    """A flush on a `MemoryStore` (a `storage.Flush`)."""

    def __init__(self, store: MemoryStore) -> None:
        self._store = store

    async def send(self, write: Write, handover: Claim | None = None) -> Written:
        if handover is not None and write.kind != "ack":
            raise ValueError(f"a hand-over is sent with an ack, not with a {write.kind}")
        return self._store._write(write, handover)


def _expired(rows: list[Row], held: set[uuid.UUID], now: datetime, heads: Heads) -> list[Row]:
    """The claim's first branch: rows whose lease expired, soonest first, unless held under a
    token of `held`; a keyed row only while it is the oldest of its key left."""
    expired = [
        row
        for row in rows
        if row.acquired_token is not None
        and row.acquired_token not in held
        and row.lease_expires_at is not None
        and row.lease_expires_at < now
        and first_of_key(row, heads)
    ]
    expired.sort(key=lambda row: (row.lease_expires_at, row.id))
    return expired


@dataclass(slots=True)
class _BreakerRow:
    """A queue's breaker, as its columns of `outbox_farm_queues` keep it."""

    failures: int = 0
    open_since: datetime | None = None
    probe_at: datetime | None = None
    reason: str | None = None


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
