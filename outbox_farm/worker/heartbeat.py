"""The lease heartbeat: one per queue, extends the leases of the rows whose handlers run.

Every `lease_ttl / 3` it sends one token-guarded extension for all of the queue's running rows
(and rows whose outcome is still being written), moving their leases to expire a full
`lease_ttl` past the store's now. A handler may therefore run far longer than its lease, and
only a worker that stopped beating (killed, hung, cut off) lets its rows expire. One missed
beat is harmless; a row the extension no longer matches was taken over, and the ledger marks
it lost so its outcome is not written.
"""

from __future__ import annotations

import asyncio
import logging

from ..errors import DatabaseError
from ..handler import HandlerSpec
from ..problems import Problems
from ..storage import Store
from .inflight import Ledger
from .supervised import Supervisor

log = logging.getLogger("outbox_farm.heartbeat")


class Heartbeat:
    def __init__(
        self,
        spec: HandlerSpec,
        ledger: Ledger,
        store: Store,
        problems: Problems,
    ) -> None:
        self.spec = spec
        self.ledger = ledger
        self.store = store
        self.problems = problems
        self.operation = f"lease heartbeat of queue {spec.queue}"
        self._task: asyncio.Task[None] | None = None

    def start(self, supervisor: Supervisor) -> None:
        self._task = supervisor.spawn(f"lease heartbeat of queue {self.spec.queue}", self._run)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    @property
    def alive(self) -> bool:
        """Its loop runs: started, and not stopped."""
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.spec.heartbeat_interval)
            ids, tokens = self.ledger.active()
            if not ids:
                continue
            try:
                matched = await self.store.extend_leases(ids, tokens, self.spec.lease_ttl)
            except DatabaseError as exc:
                if not self.problems.report(self.operation, exc, log):
                    log.warning(
                        "%s failed (%s); trying again at the next beat",
                        self.operation,
                        exc,
                        extra={"event": "heartbeat_failed", "queue": self.spec.queue},
                    )
                continue
            self.problems.solved(self.operation)
            self.ledger.extended(ids, tokens, matched)
