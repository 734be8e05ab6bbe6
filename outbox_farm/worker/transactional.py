"""Transactional handlers: the handler's writes and its row's deletion commit together.

The executor calls `InTransaction` in place of the plain handler (behind the same middleware).
A row whose transaction committed is already gone: the executor asks `written` before handing
its outcome to the completer, and writes nothing more for it.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any, cast

from .. import decision
from ..db.connect import AsyncConnection
from ..db.transactions import Completion
from ..handler import HandlerSpec
from ..message import Message
from ..observe import Observer
from .inflight import Ledger

Complete = Callable[
    [int, uuid.UUID, Callable[[AsyncConnection], Awaitable[bool]]], Awaitable[Completion]
]
"""Runs a transactional handler's work and completes its row in one transaction (the runtime
binds `db.transactions.run_completing` to a pool of its own)."""


class InTransaction:
    """One queue's transactional calls, and the rows they completed themselves."""

    def __init__(
        self, spec: HandlerSpec, ledger: Ledger, observer: Observer, complete: Complete
    ) -> None:
        self.spec = spec
        self.ledger = ledger
        self.observer = observer
        self.complete = complete
        self.committed: set[int] = set()  # rows whose transaction deleted them

    async def __call__(self, msg: Message) -> None:
        """The handler's call: its writes, and the row's deletion when it acks, commit
        together; otherwise both roll back and the row's verdict is written as usual."""
        spec = self.spec
        func = cast(Callable[[Message, AsyncConnection], Awaitable[Any]], spec.func)

        async def work(conn: AsyncConnection) -> bool:
            await func(msg, conn)
            if not decision.completes(spec, msg):
                return False
            self.ledger.writing(msg.id)  # a heartbeat racing the commit is not a lost lease
            return True

        completion = await self.complete(msg.id, msg.lease_token, work)
        if completion is Completion.COMPLETED:
            self.committed.add(msg.id)
        elif completion is Completion.LEASE_LOST:
            self.ledger.lose(msg.id, msg.lease_token, "ack")

    def written(self, msg: Message) -> bool:
        """True for a row its transaction completed: settled here, counted as acked, and
        nothing more to write."""
        if msg.id not in self.committed:
            return False
        self.committed.discard(msg.id)
        self.ledger.settle(msg.id, msg.lease_token)
        self.observer.written("ack", self.spec.queue, 1)
        return True
