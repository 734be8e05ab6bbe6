"""The in-flight ledger: every row one queue holds, under which lease token, in which state.

The fetcher adds the rows it claims and waits on `slots` when the queue is at capacity; the
executors mark a row running when its handler starts and writing when its outcome is handed
over; the heartbeat extends the leases of rows running or writing and marks those whose lease
it finds lost; the completer settles a row once its outcome is written (or given up on), which
frees its slot. All on one event loop, so nothing here locks.

Entries are keyed by row id and checked against the token: after a retry is written but before
its reply is read, the fetcher may claim the same row again, and the old write's settlement
must not remove the new claim.
"""

from __future__ import annotations

import asyncio
import enum
import uuid
from collections.abc import Iterable
from typing import Any

from ..observe import Observer


class State(enum.Enum):
    WAITING = "waiting"  # claimed, in the inbox
    RUNNING = "running"  # its handler runs
    WRITING = "writing"  # its outcome is with the completer


class Lease:
    """One held row: its claim's token, its state, whether the heartbeat found it lost. Made
    only by `Ledger.hold`, which sets the three slots itself (a constructor call would double
    the cost, once per row claimed)."""

    __slots__ = ("lost", "state", "token")
    token: uuid.UUID
    state: State
    lost: bool


_new = object.__new__
# An Enum member read off its class costs a tenth of a microsecond (Python 3.11): the states,
# read once here, since each row changes state twice.
_WAITING, _RUNNING, _WRITING = State.WAITING, State.RUNNING, State.WRITING


class Ledger:
    """The rows of one queue that this process holds."""

    def __init__(self, queue: str, capacity: int, observer: Observer) -> None:
        self.queue = queue
        self.capacity = capacity
        self.observer = observer
        self.rows: dict[int, Lease] = {}
        # The claims with rows still held, by token (keyed by the token object's id: a claim's
        # rows share that object, and UUID hashes in Python): [token, rows held under it].
        self._claims: dict[int, list[Any]] = {}
        self.slots = asyncio.Event()  # set whenever a row is settled
        # The latest claim's rows carry ordering keys: the next row of a key is claimable only
        # once this one's outcome is written (see `Completer.awaited`).
        self.keyed = False

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def free(self) -> int:
        return self.capacity - len(self.rows)

    def held(self) -> list[uuid.UUID]:
        """The tokens of every claim with a row still held: a claim must not take those rows
        again, even once their leases ran out."""
        return [claim[0] for claim in self._claims.values()]

    # -- fetcher -------------------------------------------------------------------------

    def hold(self, row_ids: Iterable[int], token: uuid.UUID) -> None:
        rows, claims = self.rows, self._claims
        before = len(rows)
        count = 0
        for row_id in row_ids:
            old = rows.get(row_id)
            if old is not None:  # claimed again (its retry was written, the reply not yet read)
                self._release(old.token)
            lease = rows[row_id] = _new(Lease)
            lease.token, lease.state, lease.lost = token, _WAITING, False
            count += 1
        if count:
            claims.setdefault(id(token), [token, 0])[1] += count
        self.observer.held(self.queue, len(rows) - before)

    # -- executors -----------------------------------------------------------------------

    def start(self, row_id: int) -> None:
        lease = self.rows.get(row_id)
        if lease is not None:
            lease.state = _RUNNING

    def finish(self, row_id: int, token: uuid.UUID) -> bool:
        """The handler returned: True when its outcome should be written, False when the
        heartbeat found the lease lost meanwhile (then the row is settled here, unwritten)."""
        lease = self.rows.get(row_id)
        if lease is None or not (lease.token is token or lease.token == token):
            return True  # not ours to judge: the write is token-guarded anyway
        if lease.lost:
            self.settle(row_id, token)
            return False
        lease.state = _WRITING
        return True

    def writing(self, row_id: int) -> None:
        """A transactional handler is about to complete its row in its own transaction: from
        now on a heartbeat that misses the row may simply have come after that commit."""
        lease = self.rows.get(row_id)
        if lease is not None:
            lease.state = _WRITING

    def lose(self, row_id: int, token: uuid.UUID, phase: str) -> None:
        """The row's lease was found lost outside the heartbeat (a transactional handler's
        completion matched nothing): its outcome will not be written."""
        lease = self.rows.get(row_id)
        if lease is None or not _same(lease.token, token) or lease.lost:
            return
        lease.lost = True
        self.observer.lease_lost(phase, self.queue, row_id, None)

    # -- heartbeat -----------------------------------------------------------------------

    def active(self) -> tuple[list[int], list[uuid.UUID]]:
        """Rows whose leases the heartbeat extends: running, or their outcome not written."""
        ids: list[int] = []
        tokens: list[uuid.UUID] = []
        for row_id, lease in self.rows.items():
            if lease.state is not _WAITING and not lease.lost:
                ids.append(row_id)
                tokens.append(lease.token)
        return ids, tokens

    def extended(self, ids: list[int], tokens: list[uuid.UUID], matched: set[int]) -> None:
        """The heartbeat's reply. A running row it did not match is held by another token (or
        gone): its handler's outcome will not be written. A row whose outcome is with the
        completer may simply have been written first, so it is left to that write."""
        for row_id, token in zip(ids, tokens, strict=True):
            if row_id in matched:
                continue
            lease = self.rows.get(row_id)
            if lease is None or lease.token != token or lease.state is not _RUNNING:
                continue
            lease.lost = True
            self.observer.lease_lost("heartbeat", self.queue, row_id, None)

    # -- completer -----------------------------------------------------------------------

    def settle(self, row_id: int, token: uuid.UUID) -> None:
        self.settle_all([(row_id, token)])

    def settle_all(self, leases: Iterable[tuple[int, uuid.UUID]]) -> None:
        """Free the slots of rows whose outcomes are written. The change is observed once per
        call: with the multiprocess registry each gauge move is a locked write to a shared file."""
        rows, claims = self.rows, self._claims
        before = len(rows)
        for row_id, token in leases:
            lease = rows.get(row_id)
            if lease is not None and (lease.token is token or lease.token == token):
                del rows[row_id]
                claim = claims[id(lease.token)]  # `_release`, written out: once per row
                claim[1] -= 1
                if not claim[1]:
                    del claims[id(lease.token)]
        if len(rows) < before:
            self.observer.held(self.queue, len(rows) - before)
            self.slots.set()

    def _release(self, token: uuid.UUID) -> None:
        """One row of the claim under `token` is no longer held."""
        claim = self._claims[id(token)]
        claim[1] -= 1
        if not claim[1]:
            del self._claims[id(token)]


def _same(held: uuid.UUID, token: uuid.UUID) -> bool:
    """`held == token`, without UUID's Python-level `__eq__` in the common case: a row's token
    reaches the executor and the completer as the very object the fetcher stored here."""
    return held is token or held == token
