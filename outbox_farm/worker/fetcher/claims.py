"""A queue's claims, and where the rows they took go: what a claim is made of (its lease token,
the sweep, the limits, the connection it may keep), and the rows held in the queue's in-flight
ledger and put in the executors' inbox, or set aside, or given back at the stop.

Its own module because it is the same for every claim, whoever decides to send it: the
fetcher's loop, the breaker's probe, the completer's hand-overs. `Claims` is the base of
`Fetcher`, which adds the loop that decides when: the completer and the runtime reach the
claims as the fetcher's (`handover`, `handed`, `ledger`). Its lines keep the fetcher's logger:
to whoever filters logs by logger they are the fetcher's claims.
"""

from __future__ import annotations

import logging
import time
import uuid

from ...errors import DatabaseError
from ...handler import HandlerSpec
from ...limits import Limits
from ...message import Message
from ...metrics import metrics
from ...observe import Observer
from ...storage import Claim, Store
from ...tokens import lease_token
from ..inbox import Inbox
from ..inflight import Ledger
from .set_aside import set_aside, unloadable

log = logging.getLogger("outbox_farm.fetcher")
# Seconds between sweeps (`Claim.sweep`: expired leases, far rows) while claims come back short
# and nothing due is left behind.
SWEEP_EVERY = 2.0


class Claims:
    """The claims of one queue, and its in-flight ledger (`ledger`): a row counts against the
    capacity from its claim until the completer settles it."""

    def __init__(
        self,
        spec: HandlerSpec,
        store: Store,
        inbox: Inbox[Message | None],
        observer: Observer,
        worker_id: int | None,
    ) -> None:
        self.spec = spec
        self.store = store
        self.inbox = inbox
        self.observer = observer
        self.worker_id = worker_id
        self.capacity = spec.capacity
        self.ledger = Ledger(spec.queue, self.capacity, observer)
        self.limits = Limits()  # the queue's farm-wide limits; none: claim as the room allows
        self._sweep_at = 0.0  # monotonic time of the next claim that sweeps (`Claim.sweep`)
        self._held_back: float | None = None  # seconds the limits asked the last claim to wait
        # Whether the store may keep something of the last claims for the next (`Claim.keep`),
        # until `Store.rest`; a store written before that method keeps nothing.
        self._keeps = getattr(store, "rest", None) is not None
        self._keeping = False
        # The next claim's lease token, made while the fetcher had nothing else to do (its
        # rest): after a rest, the new token's first use cost an idle farm's claim 18 µs of the
        # event loop, about 4 % of its commit-to-handler time. Used once (`_new_claim`).
        self._token: uuid.UUID | None = None
        self._stopping = False  # the stop began: a hand-over's rows go back (`handed`)

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

    async def _give_back(self) -> None:
        """What the claims kept for the next one goes back (`Store.rest`): before a wait
        longer than a NOTIFY's gap in a stream, for a connection kept idle longer might be
        one a server's `idle_session_timeout`, a load balancer or a NAT drops."""
        if self._keeping:
            self._keeping = False
            await self.store.rest(self.spec.queue)

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
        aside = [] if self.store.has_dlq else unloadable(msgs, self.spec.max_deliveries)
        if aside:
            msgs = [msg for msg in msgs if msg not in aside]
        if msgs:
            self.ledger.hold([msg.id for msg in msgs], claim.token)
            # The last row's: a hint, not worth a test per row.
            self.ledger.keyed = msgs[-1].ordering_key is not None
            self.inbox.put_all(msgs)
        if aside:
            await set_aside(self.store, self.spec.queue, aside, claim.token)
        return taken
