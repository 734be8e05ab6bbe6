"""The completer: every outcome of every executor, written to the table in batches.

Executors hand outcomes over with `put()`; one task flushes them when `flush_size` are
waiting or `flush_interval` after the first one arrived, whichever comes first. A flush is one
set-based write per kind of outcome (ack, retry, release, expire, terminal), which the store
sends as one flush (on Postgres, one pipeline with a sync after each write, so that a refused
DLQ move cannot roll back the acks beside it). Every write matches id and lease token. Each
row's result is counted and logged in `accounting`: written; refused (`write_failed`); taken
over by another lease (`lease_lost`); or, when a lost connection made the write go out again,
found gone or free (`outcome_unconfirmed`: its first attempt most likely wrote it). Once
written (or given up on), a row is settled in its queue's in-flight ledger, which frees its
slot; that and the other signals back to the fetchers are drawn in `channels`."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ... import storage
from ...backoff import Backoff
from ...errors import ConnectionLost
from ...observe import Observer, observers
from ...outcome import Outcome
from ...problems import Problems
from ..channels import Fetching
from ..supervised import Supervisor
from ..writes import Statement, statements
from .accounting import Accounting

log = logging.getLogger("outbox_farm.completer")
AT_ONCE = 4  # rows held, at most, for a batch to be written without waiting
# Seconds since the last write under which a handful of unkeyed outcomes wait for their interval
# all the same, while their fetchers can claim more: a stream, not a lone message (`awaited`).
STREAM_GAP = 0.002
# Past the stop deadline, a final flush whose database sent nothing for this long is given up.
STALL = 1.0


@dataclass(slots=True)
class _Handover:
    """A claim sent with the ack of a flush, and the fetcher that takes its rows."""

    fetcher: Fetching
    claim: storage.Claim


class Completer:
    """Batches outcomes into lease-guarded writes.

    State: `_pending` is appended to by executors (`offer`, `put`) and swapped out by the flush
    task; both run on the one event loop, so no lock is needed.
    """

    def __init__(
        self,
        store: storage.Store,
        *,
        flush_interval: float = 0.01,
        flush_size: int = 1000,
        high_water: int = 20_000,
        problems: Problems | None = None,
        observer: Observer | None = None,
    ) -> None:
        self.store = store
        self.flush_interval = flush_interval
        self.flush_size = flush_size
        self.high_water = high_water
        self._quick = min(flush_size - 1, high_water)  # `offer` appends below this
        self.fetchers: Mapping[str, Fetching] = {}  # see `connect`
        self._pending: list[Outcome] = []
        self._wake = asyncio.Event()  # set when the first outcome of a batch arrives
        self._full = asyncio.Event()  # set when a batch reached flush_size, or at close
        self._room = asyncio.Event()  # set while the backlog is under high_water
        self._room.set()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        # The statements of the write under way not yet answered, and when the database last
        # showed it answers (a reply, or the start of a write): what `close` judges by.
        self._todo: list[Statement] = []
        self._progress = 0.0
        self.written_at = -math.inf  # monotonic time the last write ended
        self.observer = observer or observers()
        self.accounting = Accounting(store, self.observer, problems or Problems(), self._retry_due)

    # -- executor side -------------------------------------------------------------------

    def offer(self, outcome: Outcome) -> bool:
        """Queue an outcome when that needs no wait (neither a full batch nor a backlog): the
        common case, without a coroutine; False: `put` it instead."""
        pending = self._pending
        if len(pending) < self._quick:
            if not pending:
                self._wake.set()  # the first outcome of a batch
            pending.append(outcome)
            return True
        return False

    async def put(self, outcome: Outcome) -> None:
        """Queue an outcome; waits while the completer is `high_water` outcomes behind."""
        if self.offer(outcome):
            return
        await self._room_left()
        self._add((outcome,))

    async def put_all(self, outcomes: list[Outcome]) -> None:
        """Queue a batch handler's outcomes at once; waits, as `put`, while the completer is
        `high_water` outcomes behind (the batch may then take it past that mark)."""
        if not outcomes:  # every row's lease was lost while it ran: nothing to write
            return
        await self._room_left()
        self._add(outcomes)

    def put_nowait(self, outcome: Outcome) -> None:
        """Queue an outcome without waiting (for cancelled executors that cannot wait)."""
        self._add((outcome,))

    async def _room_left(self) -> None:
        while len(self._pending) >= self.high_water:
            self._room.clear()
            await self._room.wait()

    def _add(self, outcomes: Iterable[Outcome]) -> None:
        self._pending.extend(outcomes)
        self._wake.set()
        if len(self._pending) >= self.flush_size:
            self._full.set()

    def flush_now(self) -> None:
        """Write what is waiting without waiting for the interval (a fetcher is out of slots)."""
        if self._pending:
            self._full.set()

    # -- lifecycle -----------------------------------------------------------------------

    def connect(self, fetchers: Mapping[str, Fetching]) -> None:
        """The back-channels to each queue's fetcher (see `channels`), once, before the start;
        a queue without one has its outcomes written, and nothing told of them."""
        self.fetchers = dict(fetchers)

    def start(self, supervisor: Supervisor) -> None:
        self._task = supervisor.spawn("completer", self._run)

    @property
    def alive(self) -> bool:
        """Its flush task runs: started, and not yet ended by `close()`."""
        return self._task is not None and not self._task.done()

    async def close(self, deadline: float, *, overtime: float = 0.0) -> None:
        """Final flush of everything queued, then stop, by `deadline` (monotonic).

        Past the deadline the flush goes on only while the database answers it: for at most
        `overtime` more seconds, and only while its last reply (or the start of its write)
        is less than `STALL` seconds old, so outcomes of handlers that ended just before the
        deadline are still written, and an unreachable database costs no overtime at all.
        Outcomes still unwritten then are given up: their rows keep their leases and are
        delivered again when the leases expire (at least once, as after a crash).
        """
        self._closing = True
        self._wake.set()
        self._full.set()
        task = self._task
        if task is None:
            return
        now = time.monotonic()
        if not self._todo:
            self._progress = now  # nothing in flight: the final write gets its STALL too
        last = max(deadline, now) + overtime
        while not task.done():
            now = time.monotonic()
            until = deadline if now < deadline else min(self._progress + STALL, last)
            if until <= now:
                break
            await asyncio.wait({task}, timeout=until - now)
        if task.done():
            return
        unwritten = [o for stmt in self._todo for o in stmt.outcomes] + self._pending
        log.error(
            "completer gave up the final flush at the stop deadline: %d outcomes not written "
            "(no reply from the database for %.1fs); their rows are delivered again when their "
            "leases expire",
            len(unwritten),
            time.monotonic() - self._progress,
            extra={"event": "flush_abandoned", "outcomes": len(unwritten)},
        )
        task.cancel()
        self.accounting.given_up(unwritten)

    async def _run(self) -> None:
        while (batch := await self._collect()) is not None:
            try:
                await self.write(batch)
            except Exception:  # a bug here must not stop every later write of the process
                log.exception(
                    "completer failed to write %d outcomes; their rows will be delivered again "
                    "after their leases expire",
                    len(batch),
                    extra={"event": "flush_failed"},
                )
                self.accounting.given_up(batch)

    async def _collect(self) -> list[Outcome] | None:
        """The next batch, once it is due (full, or `flush_interval` after its first outcome);
        None at close, once nothing is left."""
        while not self._pending:
            if self._closing:
                return None
            self._wake.clear()
            await self._wake.wait()
        if (
            len(self._pending) < self.flush_size
            and not self._closing
            and not self.awaited(len(self._pending))
        ):
            try:
                async with asyncio.timeout(self.flush_interval):
                    await self._full.wait()
            except TimeoutError:
                pass
        batch, self._pending = self._pending, []
        self._full.clear()
        self._room.set()
        return batch

    def awaited(self, waiting: int) -> bool:
        """Whether the batch goes now rather than `flush_interval` after its first outcome: the
        process holds only a handful of rows (`AT_ONCE`), all of them with their outcome here,
        so no more are coming this interval; unless they come as a stream (below). Nothing is
        gained by waiting then, and much lost:
        - a keyed queue's next row of the key no process can claim until this batch deletes
          the one before it, so a hot key would move a row per interval, not per round trip;
        - on a farm taking a message every few milliseconds, the write would land on the
          claim and the hand-off of a message that came after it (at 200 msg/s and a 10 ms
          interval, of the one two messages on, every time), and add to its latency.
        A busy process keeps its batches: flushing each claim's worth at once there measured
        slower (more, smaller writes, each waking every fetcher of the queue). So does a steady
        stream of lone messages, whose outcomes come within `STREAM_GAP` of the last write: at
        2,000 msg/s a write per message cost a round trip and a commit each, and the tail of
        commit-to-handler measured 10-20 % longer than with the interval's batches. A stream
        keeps its batches only while no queue holding rows is keyed and every such queue's
        fetcher can claim its next rows before this write (`Fetching.has_room`): else the
        write is what the next row waits for (a queue of one running row would move a row per
        interval). And a queue under a running limit has every outcome written at once, however
        many rows its process holds: the place each frees is the scarce thing, which this
        process takes back as soon as it is written (the interval would add a fifth to the
        time a 50 ms handler holds its place)."""
        held = 0
        keyed = False
        room = True
        for fetcher in self.fetchers.values():
            ledger = fetcher.ledger
            rows = len(ledger.rows)
            if rows:
                if fetcher.running_limited:
                    return True
                held += rows
                keyed = keyed or ledger.keyed
                room = room and fetcher.has_room
        if held > min(waiting, AT_ONCE):
            return False
        return keyed or not room or time.monotonic() - self.written_at >= STREAM_GAP

    # -- writing -------------------------------------------------------------------------

    async def write(self, batch: list[Outcome]) -> None:
        """Write `batch` as one flush, now; only then do its rows stop counting against their
        queue's capacity. The flush task calls this for every batch it collects.

        Freeing a slot at hand-over instead would let a worker whose writes are slow hold an
        unbounded number of leased rows, all of which a crash would then deliver again.
        """
        try:
            await self._write(batch)
        finally:
            self._todo = []
            self.written_at = time.monotonic()
            by_queue: dict[str, list[Outcome]] = defaultdict(list)
            queues = {outcome.queue for outcome in batch}
            if len(queues) == 1:  # the common case: the batch as it is
                by_queue[queues.pop()] = batch
            else:
                for outcome in batch:
                    by_queue[outcome.queue].append(outcome)
            for queue, outcomes in by_queue.items():
                fetcher = self.fetchers.get(queue)
                if fetcher is not None:
                    fetcher.ledger.settle_all((o.row_id, o.token) for o in outcomes)

    def _handover(self, batch: list[Outcome], ack: Statement) -> _Handover | None:
        """The claim to send with `ack`, the first write of a batch the process holds almost
        nothing but (`awaited`): the next row of every key of one keyed queue it deletes a
        row of. That row becomes claimable only with this deletion; taken by the ack itself
        (`ack_next`), it runs one round trip after it instead of three (the ack, the NOTIFY,
        the claim), and no other process is woken to find it taken. Not at the stop: the
        executors take nothing new then."""
        if self._closing or not self.awaited(len(batch)):
            return None
        for queue in {outcome.queue for outcome in ack.outcomes}:
            fetcher = self.fetchers.get(queue)
            if fetcher is not None and fetcher.ledger.keyed and fetcher.hands_over:
                return _Handover(fetcher, fetcher.handover())
        return None

    async def _write(self, batch: list[Outcome]) -> None:
        started = time.perf_counter()
        todo = self._todo = statements(batch, dlq=self.store.has_dlq)
        self._progress = time.monotonic()
        taking = self._handover(batch, todo[0]) if todo and todo[0].phase == "ack" else None
        backoff = Backoff()
        while todo:
            # A hand-over's ack alone goes without pipeline mode, a round trip sooner. Other
            # flushes keep it: measured, a busy flush's per-message cost came out lower with it,
            # and a lone message's ack without it lengthened the tail at 200 msg/s.
            single = len(todo) == 1 and taking is not None
            try:
                async with self.store.flush(single=single) as flush:
                    while todo:
                        sent = time.perf_counter()
                        handing, taking = taking, None  # the first write only, never sent again
                        claim = handing.claim if handing is not None else None
                        written = await flush.send(todo[0].write, claim)
                        self._progress = time.monotonic()
                        self.accounting.account(todo.pop(0), written)
                        if handing is not None and written.claimed:
                            await handing.fetcher.handed(
                                handing.claim, written.claimed, time.perf_counter() - sent
                            )
            except ConnectionLost as exc:
                if not todo:
                    break  # the connection broke after the last reply: everything is written
                if self._closing and backoff.failures >= 8:
                    log.error(
                        "completer gave up writing at stop: %s",
                        exc,
                        extra={"event": "flush_abandoned"},
                    )
                    self.accounting.given_up([o for stmt in todo for o in stmt.outcomes])
                    return
                delay = backoff.next()
                log.warning(
                    "completer lost its database connection (%s); retrying in %.2fs",
                    exc,
                    delay,
                    extra={"event": "db_reconnect", "component": "completer"},
                )
                await asyncio.sleep(delay)
        self.observer.flushed(time.perf_counter() - started, len(batch))

    def _retry_due(self, queue: str, delay: float) -> None:
        fetcher = self.fetchers.get(queue)
        if fetcher is not None:
            fetcher.note_due(delay)
