"""The fetcher: one per queue, claims rows into the executors' inbox.

It never holds more rows than the queue's capacity (executors plus prefetch), claims again at
once when a claim came back full, and otherwise sleeps until the first of: a NOTIFY for its
queue, the next due time it knows of (delayed rows, retries, expiring leases, so those fire on
time), or a jittered poll interval that keeps processes from running in step. It asks the
database for that due time after a claim that came back short, but after one that took rows
only once no NOTIFY came within `LOOK_AGAIN`: in a stream of messages the next NOTIFY usually
comes first, and its claim would otherwise wait behind the query's round trip.

A stall is never silent: the fetcher counts its failed claims (`Observer.claim_failed`), and
reports the queue stalled (`Observer.stalled`, and `stall.reason` for the runtime's `problem`)
when its claims failed STALL_FAILURES times in a row or for STALL_FAILING_FOR seconds, or when
two idle fetches in a row (nothing held, an empty claim) find a ready row due for more than
STALL_OVERDUE seconds: the farm has room, yet that row is not taken.

While the completer finds its rows' acks or retries refused for want of a privilege, the
queue's claims are paused: the fetcher probes the refused write on a clock instead (see `pause`).
While an operator holds the queue (`hold`, from the queue controls' watcher), it claims nothing
and waits for the release alone; the rows it holds already run and are written as usual.
While the queue has farm-wide limits (`limit`, from the same watcher), each claim asks the store
for what the limits allow (`Store.claim_limited`), and one cut short by them waits for the time
the store says the limits need, instead of a poll.

How a claim is made and where its rows go are `claims`'s (a row set aside, `set_aside`'s); the
probe of an open breaker is `probe`'s; the due times a sleep ends at are `due`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time

from ...backoff import Backoff
from ...errors import ConnectionLost, DatabaseError, PermanentError
from ...handler import HandlerSpec
from ...limits import Limits
from ...message import Message
from ...observe import Observer
from ...problems import Problems, Stall
from ...storage import Store
from ...tokens import lease_token
from ..breaker import QueueBreaker
from ..channels import Flushing
from ..inbox import Inbox
from ..pause import Pause
from ..supervised import Supervisor
from .claims import Claims
from .due import DueTimes
from .probe import probe, probe_wait

log = logging.getLogger("outbox_farm.fetcher")
LOOK_AGAIN = 0.02  # seconds a claim that took rows waits for a NOTIFY before next-due
STALL_FAILURES = 5  # claims failed in a row that make the queue stalled ...
STALL_FAILING_FOR = 30.0  # ... or seconds of failing claims
STALL_OVERDUE = 60.0  # seconds a ready row may wait while the farm is idle
STRANDED_EVERY = 2.0  # seconds between looks for rows left marked at the head of their key


def _error_kind(exc: BaseException) -> str:
    """The `kind` label of a failed claim."""
    if isinstance(exc, ConnectionLost):
        return "connection_lost"
    if isinstance(exc, PermanentError):
        return "permanent"
    return "refused" if isinstance(exc, DatabaseError) else "internal"


class Fetcher(Claims):
    """Claims for one queue (`Claims`: how, and where the rows go), and decides when. The
    completer sees it as `channels.Fetching`; it sees the completer as `channels.Flushing`."""

    def __init__(
        self,
        spec: HandlerSpec,
        store: Store,
        inbox: Inbox[Message | None],
        observer: Observer,
        completer: Flushing,
        *,
        poll_interval: float = 0.5,
        worker_id: int | None = None,
        problems: Problems | None = None,
    ) -> None:
        super().__init__(spec, store, inbox, observer, worker_id)
        self.poll_interval = poll_interval
        self.problems = problems or Problems()
        self.pause = Pause(spec.queue, self.problems, log)
        self.completer = completer
        self.operation = f"claim for queue {spec.queue}"
        self._stranded_at = 0.0  # monotonic time of the next look for stranded keyed rows
        # Claim in halves of the capacity: one half is handled while the other half's outcomes
        # are written, so claims and writes overlap; and claim only when a half fits, unless
        # nothing is in flight at all.
        self.batch = max(1, self.capacity // 2)
        self._wake = asyncio.Event()
        self._due = DueTimes()
        self.stall = Stall(
            spec.queue,
            failures=STALL_FAILURES,
            failing_for=STALL_FAILING_FOR,
            overdue=STALL_OVERDUE,
        )
        self._task: asyncio.Task[None] | None = None
        self.held_by: str | None = None  # why an operator holds the queue; None: claim
        self.breaker: QueueBreaker | None = None  # the queue's, when it has one (`runtime`)

    # -- called by other components ------------------------------------------------------

    def wake(self) -> None:
        """Something may be claimable now (NOTIFY, listener reconnect)."""
        self._wake.set()

    def hold(self, why: str) -> None:
        """Claim nothing more (an operator paused the queue) until `release`: the claim
        under way, if any, still delivers its rows. A paused queue is not stalled."""
        self.held_by = why
        if self.stall.paused():
            self.observer.stalled(self.spec.queue, None)

    def release(self) -> None:
        """Claim again, at once."""
        self.held_by = None
        self._wake.set()

    @property
    def hands_over(self) -> bool:
        """See `channels.Fetching.hands_over`."""
        return self.held_by is None and not self.limits

    @property
    def has_room(self) -> bool:
        """See `channels.Fetching.has_room`: a claim now waits neither for a slot (`starved`)
        nor for an operator or the limits."""
        return self.hands_over and not self.starved

    @property
    def starved(self) -> bool:
        """The next claim waits for slots, which only written outcomes free: less than a batch
        is free while rows are held (with none held, the whole capacity is)."""
        return self.ledger.free < self.batch and bool(len(self.ledger))

    @property
    def running_limited(self) -> bool:
        """See `channels.Fetching.running_limited`."""
        return self.limits.max_running is not None or self.limits.key_max_running is not None

    def limit(self, limits: Limits) -> None:
        """Claim within `limits` from now on (`Limits()`: without), starting at once: the
        claim under way, if any, still delivers its rows, as at a `hold`."""
        self.limits = limits
        self._wake.set()

    def note_due(self, delay: float) -> None:
        """A row of this queue becomes due in `delay` seconds (a retry just written)."""
        if self._due.note(delay):
            self._wake.set()  # re-arm the sleep with the earlier deadline

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, supervisor: Supervisor) -> None:
        self._task = supervisor.spawn(f"fetcher of queue {self.spec.queue}", self._run)

    async def stop(self) -> None:
        """Stop claiming. A claim already sent is allowed to finish so its rows are known."""
        self._stopping = True
        self._wake.set()
        self.pause.stop()
        self.ledger.slots.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    @property
    def alive(self) -> bool:
        """Its loop runs: started, not stopped, not ended by an error it did not expect."""
        return self._task is not None and not self._task.done()

    # -- the loop ------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._claim_loop()
        finally:
            await self._give_back()  # however the loop ended

    async def _claim_loop(self) -> None:
        """Claim, wait, claim. What the claims keep in the store (a connection) stays with
        the fetcher only through the short look for the next NOTIFY after a claim that took
        rows (`_woken_soon`), and then only when a claim follows at once: any other wait gives
        it back first (`_give_back`)."""
        backoff = Backoff()
        ledger = self.ledger
        keep = False
        while not self._stopping:
            if self._keeping and not (keep and self._claims_now):
                await self._give_back()
            keep = False
            if self.starved:
                ledger.slots.clear()
                self.completer.flush_now()  # outcomes written free slots: write them now
                await ledger.slots.wait()
                continue
            self._wake.clear()
            if self.held_by is not None:
                await self._wake.wait()  # set by `release`, by a stop, or by a NOTIFY
                continue
            want = min(ledger.free, self.batch)
            try:
                if self.breaker is not None and self.breaker.tripped is not None:
                    await self._probe(self.breaker)  # setting its row aside fails as a claim does
                    continue
                if await self.pause.held():
                    continue
                claimed_at = time.monotonic()
                got = await self._claimed(want)
                if got == want:
                    backoff.reset()
                    continue  # more may be waiting: claim again at once
                if self._held_back is not None:  # cut short by the limits, not by the rows
                    backoff.reset()
                    await self._give_back()
                    await self._held(self._held_back)
                    continue
                if got:
                    # Let the executors start on what came in before the look for the next
                    # due row: its statement's set-up would otherwise run first, and an idle
                    # farm's rows wait for it (a fifth of a millisecond, a quarter of its
                    # commit-to-handler time).
                    await asyncio.sleep(0)
                    if await self._woken_soon(claimed_at):
                        backoff.reset()
                        keep = True
                        continue
                wait = await self._next_wait(idle=not len(ledger))
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
            await self._give_back()
            await self._rest(wait)

    @property
    def _claims_now(self) -> bool:
        """The loop's next step is a claim, with no wait before it: none of the waits that
        come before the claim in `_claim_loop` (a new one there belongs here too)."""
        return (
            not self.starved
            and self.held_by is None
            and (self.breaker is None or self.breaker.tripped is None)
            and not self.pause.paused
        )

    async def _woken_soon(self, claimed_at: float) -> bool:
        """After a claim, sent at `claimed_at`, that took rows: whether a NOTIFY (or a retry,
        a release) woke the fetcher within `LOOK_AGAIN` seconds, before any row known to be
        due then (`DueTimes.look`). Only then is the next-due query sent: in a stream of
        messages a NOTIFY usually comes first, and its claim would otherwise wait behind that
        query's round trip."""
        now = time.monotonic()
        window = self._due.look(LOOK_AGAIN, claimed_at, now)
        if window <= 0 or now >= self._stranded_at:
            return False  # a due row or a look for stranded rows comes first
        return await self._rest(window)

    async def _rest(self, wait: float) -> bool:
        """Sleep `wait` seconds, or until woken (not at all once stopping); whether woken."""
        if self._stopping:
            return False
        if self._token is None:
            self._token = lease_token(self.worker_id)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                await self._wake.wait()
                return True
        return False

    async def _held(self, wait: float) -> None:
        """Sleep `wait` seconds, the time the limits asked for, or until woken; under a
        `max_running`, sooner too when one of this process's rows of the queue is written: the
        place it held is free then, and this process, which saw it first, claims it (the others
        find it at their next look)."""
        self.ledger.slots.clear()
        waiters = [asyncio.ensure_future(self._wake.wait())]
        if self.limits.max_running is not None:
            waiters.append(asyncio.ensure_future(self.ledger.slots.wait()))
        try:
            await asyncio.wait(waiters, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    async def _probe(self, breaker: QueueBreaker) -> None:
        """While the queue's breaker is open, claim nothing but its probe (see `probe`). A
        breaker open is no stall, as a pause is none. Its row's set-aside refused (`_take`) is
        raised, for the loop to back off as after a failed claim."""
        if self.stall.paused():
            self.observer.stalled(self.spec.queue, None)
        wait = probe_wait(breaker, self.ledger.rows)
        if wait is not None:
            await self._rest(wait)
            return
        probed = await probe(self.store, breaker, self._new_claim)
        if probed is not None:
            await self._take(*probed)
            # A claim that went through: a problem its set-aside reported is over, as after
            # any claim (no other claim runs to say so while the breaker is open).
            self.problems.solved(self.operation)

    async def _free_stranded(self) -> int:
        """At most every `STRANDED_EVERY` seconds, when a claim came back short: unmark the
        queue's rows left marked `key_blocked` at the head of their key (see
        `Store.free_stranded`), which no claim would otherwise take; how many. A queue whose
        claims all come back full has rows enough to run meanwhile. Its failure is the
        claim's: the same connection problems."""
        now = time.monotonic()
        if now < self._stranded_at:
            return 0
        self._stranded_at = now + STRANDED_EVERY
        freed = await self.store.free_stranded(self.spec.queue)
        if freed:
            log.info(
                "unmarked %d row(s) of queue %s left waiting at the head of their ordering key",
                freed,
                self.spec.queue,
                extra={"event": "stranded_freed", "queue": self.spec.queue, "rows": freed},
            )
        return freed

    async def _claimed(self, want: int) -> int:
        """`_claim(want)`, its failure counted and its success or failure told to the stall
        watch. An error that is not the database's propagates to the supervisor."""
        try:
            got = await self._claim(want)
        except Exception as exc:
            self.observer.claim_failed(self.spec.queue, _error_kind(exc))
            if self.stall.claim_failed(exc):
                self.observer.stalled(self.spec.queue, self.stall.reason)
            raise
        self.problems.solved(self.operation)
        if self.stall.claimed(got):
            self.observer.stalled(self.spec.queue, None)
        return got

    async def _next_wait(self, *, idle: bool) -> float:
        """Seconds to sleep: the poll interval, or less when something is due sooner (none
        when stranded keyed rows were just freed). `idle`: the claim came back short and
        nothing of the queue is held, so a row overdue now is one the farm could run and does
        not (see `Stall.idle`)."""
        wait = self.poll_interval * random.uniform(0.9, 1.1)
        if await self._free_stranded():
            return 0.0
        due = await self.store.next_due(self.spec.queue)
        if idle and self.stall.idle(-due if due is not None else 0.0):
            self.observer.stalled(self.spec.queue, self.stall.reason)
        if due is not None and due <= 0:  # due now, yet the claim took none: maybe an expired lease
            self._sweep_at = 0.0
        return self._due.after_query(wait, due)
