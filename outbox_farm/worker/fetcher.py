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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid

from ..backoff import Backoff
from ..errors import ConnectionLost, DatabaseError, PermanentError
from ..handler import HandlerSpec
from ..limits import Limits
from ..message import Message
from ..metrics import metrics
from ..observe import Observer
from ..problems import Problems, Stall
from ..storage import Claim, Store
from ..tokens import lease_token
from .breaker import QueueBreaker
from .channels import Flushing
from .inbox import Inbox
from .inflight import Ledger
from .pause import Pause
from .supervised import Supervisor

log = logging.getLogger("outbox_farm.fetcher")
DUE_SLACK = 0.001  # wake a hair late rather than early: an early claim finds nothing
LOOK_AGAIN = 0.02  # seconds a claim that took rows waits for a NOTIFY before next-due
STALL_FAILURES = 5  # claims failed in a row that make the queue stalled ...
STALL_FAILING_FOR = 30.0  # ... or seconds of failing claims
STALL_OVERDUE = 60.0  # seconds a ready row may wait while the farm is idle
# Seconds between sweeps (`Claim.sweep`: expired leases, far rows) while claims come back short
# and nothing due is left behind.
SWEEP_EVERY = 2.0
STRANDED_EVERY = 2.0  # seconds between looks for rows left marked at the head of their key
SET_ASIDE_SECONDS = 3600.0
"""How long a row set aside stays so before it is claimed (and reported) again: often enough
that the warning is not forgotten, seldom enough not to flood the log."""


def _error_kind(exc: BaseException) -> str:
    """The `kind` label of a failed claim."""
    if isinstance(exc, ConnectionLost):
        return "connection_lost"
    if isinstance(exc, PermanentError):
        return "permanent"
    return "refused" if isinstance(exc, DatabaseError) else "internal"


class Fetcher:
    """Claims for one queue, and owns the queue's in-flight ledger (`ledger`): a row counts
    against the capacity from its claim until the completer settles it. The completer sees it
    as `channels.Fetching`; it sees the completer as `channels.Flushing`."""

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
        self.spec = spec
        self.store = store
        self.inbox = inbox
        self.observer = observer
        self.poll_interval = poll_interval
        self.worker_id = worker_id
        self.problems = problems or Problems()
        self.pause = Pause(spec.queue, self.problems, log)
        self.completer = completer
        self.operation = f"claim for queue {spec.queue}"
        self._sweep_at = 0.0  # monotonic time of the next claim that sweeps (`Claim.sweep`)
        self._stranded_at = 0.0  # monotonic time of the next look for stranded keyed rows
        self.capacity = spec.capacity
        self.ledger = Ledger(spec.queue, self.capacity, observer)
        # Claim in halves of the capacity: one half is handled while the other half's outcomes
        # are written, so claims and writes overlap; and claim only when a half fits, unless
        # nothing is in flight at all.
        self.batch = max(1, self.capacity // 2)
        self._wake = asyncio.Event()
        self._due_at: float | None = None  # monotonic time of the earliest known due row
        self._db_due_at: float | None = None  # ... as the last next-due query found it
        self.stall = Stall(
            spec.queue,
            failures=STALL_FAILURES,
            failing_for=STALL_FAILING_FOR,
            overdue=STALL_OVERDUE,
        )
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self.held_by: str | None = None  # why an operator holds the queue; None: claim
        self.limits = Limits()  # the queue's farm-wide limits; none: claim as the room allows
        self._held_back: float | None = None  # seconds the limits asked the last claim to wait
        self.breaker: QueueBreaker | None = None  # the queue's, when it has one (`runtime`)
        # Whether the store may keep something of the last claims for the next (`Claim.keep`),
        # until `Store.rest`; a store written before that method keeps nothing.
        self._keeps = getattr(store, "rest", None) is not None
        self._keeping = False
        # The next claim's lease token, made while the fetcher had nothing else to do (`_rest`):
        # after a rest, the new token's first use cost an idle farm's claim 18 µs of the event
        # loop, about 4 % of its commit-to-handler time. Used once (`_new_claim`).
        self._token: uuid.UUID | None = None

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
        due = time.monotonic() + delay
        if self._due_at is None or due < self._due_at:
            self._due_at = due
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

    async def _give_back(self) -> None:
        """What the claims kept for the next one goes back (`Store.rest`): before a wait
        longer than a NOTIFY's gap in a stream, for a connection kept idle longer might be
        one a server's `idle_session_timeout`, a load balancer or a NAT drops."""
        if self._keeping:
            self._keeping = False
            await self.store.rest(self.spec.queue)

    async def _woken_soon(self, claimed_at: float) -> bool:
        """After a claim, sent at `claimed_at`, that took rows: whether a NOTIFY (or a retry,
        a release) woke the fetcher within `LOOK_AGAIN` seconds, before any row known to be
        due then. Only then is the next-due query sent: in a stream of messages a NOTIFY
        usually comes first, and its claim would otherwise wait behind that query's round
        trip. A row that was due before the claim was sent was the claim's to take, so its
        due time no longer cuts the look short (else one such time, never asked again,
        would send the query after every claim)."""
        window = LOOK_AGAIN
        now = time.monotonic()
        for due in (self._due_at, self._db_due_at):
            if due is not None and due > claimed_at:
                window = min(window, due - now)
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
        """While the queue's breaker is open, claim nothing but its probe: one row, when this
        process wins the probe's turn (one process of one host wins each interval), and only
        once its last probe ended. A breaker open is no stall, as a pause is none. A refused
        turn or claim leaves the probe to the next interval; its row's set-aside refused
        (`_take`) is raised, for the loop to back off as after a failed claim."""
        if self.stall.paused():
            self.observer.stalled(self.spec.queue, None)
        # A probe written without a run (past `max_deliveries`, say) is over too.
        breaker.probes.intersection_update(self.ledger.rows)
        wait = breaker.probe_at - time.monotonic()
        if breaker.probes or wait > 0:
            await self._rest(wait if wait > 0 else breaker.breaker.probe_every)
            return
        queue = self.spec.queue
        try:
            won = await self.store.breaker_probe(queue, breaker.breaker.probe_every)
            breaker.probed(won)
            if not won:
                return
            claim = self._new_claim(1)
            msgs = await self.store.claim(claim)
        except DatabaseError as exc:
            log.debug("probe of queue %s not claimed (%s)", queue, exc)
            breaker.probed(False)
            return
        breaker.probes.update(msg.id for msg in msgs)
        if msgs:
            log.info(
                "probing queue %s's downstream with row %s",
                queue,
                msgs[0].id,
                extra={"event": "breaker_probe", "queue": queue, "row_id": msgs[0].id},
            )
        await self._take(claim, msgs)

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

    async def _claim(self, limit: int) -> int:
        started = time.perf_counter()
        claim = self._new_claim(limit)
        sweep = claim.sweep
        self._held_back = None
        if self.limits:
            allowed = await self.store.claim_limited(claim)
            msgs = allowed.messages
            if allowed.allowed < limit and len(msgs) == allowed.allowed:
                # Cut short by the limits (a claim that found fewer rows than they allowed
                # was not): rows may be waiting.
                metrics().limited_claims.labels(self.spec.queue).inc()
                self._held_back = allowed.wait
        else:
            msgs = await self.store.claim(claim)
        if sweep and len(msgs) < limit:  # a full claim may have left swept rows out
            self._sweep_at = time.monotonic() + SWEEP_EVERY
        self.observer.claimed(self.spec.queue, len(msgs), time.perf_counter() - started)
        return await self._take(claim, msgs)

    def _new_claim(self, limit: int | None) -> Claim:
        """A claim of up to `limit` rows (None: a hand-over), made now. Its lease runs from the
        claim's time in the store, which is after this moment: a deadline counted from here
        errs on the early side."""
        spec = self.spec
        sent = time.monotonic()
        sweep = limit is not None and sent >= self._sweep_at
        held = self.ledger.held() if limit is not None else []
        start_by = sent + spec.lease_ttl - spec.start_margin
        token, self._token = self._token or lease_token(self.worker_id), None
        keep = limit is not None and self._keeps  # the loop's: it says when it rests
        self._keeping = self._keeping or keep
        return Claim(spec.queue, limit, spec.lease_ttl, token, sent, start_by, held, sweep, keep)

    def handover(self) -> Claim:
        """The claim of the next rows of the keys an ack deletes rows of, for the completer to
        send with that ack (see `Completer._handover`). At most one row per row acked: the
        queue stays within its capacity even beside a claim of the loop's."""
        return self._new_claim(None)

    async def handed(self, claim: Claim, messages: list[Message], seconds: float) -> None:
        """The messages a claim sent with a write took (`handover`): counted, and in the inbox;
        or, when the stop began meanwhile (the executors may have swept their inbox already),
        released at once."""
        self.observer.claimed(self.spec.queue, len(messages), seconds)
        if not self._stopping:
            await self._take(claim, messages)
            return
        ids = [msg.id for msg in messages]
        try:
            await self.store.give_back(ids, claim.token)
        except DatabaseError as exc:
            log.warning(
                "could not release rows %s of queue %s, claimed as the stop began (%s); they "
                "are delivered again when their leases expire",
                ids,
                self.spec.queue,
                exc,
                extra={"event": "release_failed", "queue": self.spec.queue},
            )

    async def _take(self, claim: Claim, msgs: list[Message]) -> int:
        """Hold the messages `claim` took and hand them to the executors; how many.

        A row the claim could not load (`invalid`) is handed over too: the executor
        dead-letters it unrun as `invalid_row`, through the completer's token-guarded DLQ move
        like any terminal row. With no DLQ to keep it, it is set aside instead (until
        `max_deliveries`, which holds for it as for any row): deleting a row nobody could read
        is not the farm's call."""
        if not msgs:
            return 0
        taken = len(msgs)
        aside: list[Message] = []
        if not self.store.has_dlq:
            most = self.spec.max_deliveries
            aside = [
                msg
                for msg in msgs
                if msg.invalid is not None and (most is None or msg.deliveries_count <= most)
            ]
            if aside:
                msgs = [msg for msg in msgs if msg not in aside]
        if msgs:
            self.ledger.hold([msg.id for msg in msgs], claim.token)
            # The last row's: a hint, not worth a test per row.
            self.ledger.keyed = msgs[-1].ordering_key is not None
            self.inbox.put_all(msgs)
        if aside:
            await self._set_aside(aside, claim.token)
        return taken

    async def _set_aside(self, msgs: list[Message], token: uuid.UUID) -> None:
        """Park rows that can be neither loaded nor dead-lettered (see `Store.set_aside`),
        each reported by id: a WARNING `row_set_aside` and `outbox_farm_set_aside_total`."""
        queue = self.spec.queue
        ids = [msg.id for msg in msgs]
        parked = set(await self.store.set_aside(ids, token, SET_ASIDE_SECONDS))
        for row_id, why in ((msg.id, msg.invalid) for msg in msgs):
            if row_id not in parked:
                continue  # taken over by another lease meanwhile: that runner reports it
            log.warning(
                "row %s of queue %s cannot be loaded (%s) and there is no DLQ to keep it: set "
                "aside for %gs, then claimed and reported again (fix or delete it by hand)",
                row_id,
                queue,
                why,
                SET_ASIDE_SECONDS,
                extra={"event": "row_set_aside", "row_id": row_id, "queue": queue, "why": why},
            )
        if parked:
            metrics().set_aside.labels(queue).inc(len(parked))

    async def _next_wait(self, *, idle: bool) -> float:
        """Seconds to sleep: the poll interval, or less when something is due sooner (none
        when stranded keyed rows were just freed). `idle`: the claim came back short and
        nothing of the queue is held, so a row overdue now is one the farm could run and does
        not (see `Stall.idle`)."""
        wait = self.poll_interval * random.uniform(0.9, 1.1)
        if await self._free_stranded():
            return 0.0
        due = await self.store.next_due(self.spec.queue)
        self._db_due_at = time.monotonic() + due if due is not None else None
        if idle and self.stall.idle(-due if due is not None else 0.0):
            self.observer.stalled(self.spec.queue, self.stall.reason)
        if due is not None:
            if due <= 0:  # due now, yet the claim took none: maybe an expired lease
                self._sweep_at = 0.0
            wait = min(wait, max(due, 0.0) + DUE_SLACK)
        if self._due_at is not None:
            local = self._due_at - time.monotonic()
            if local <= 0:
                self._due_at = None
            wait = min(wait, max(local, 0.0) + DUE_SLACK)
        return wait
