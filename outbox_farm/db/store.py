"""The storage port on PostgreSQL: what one process's runtime asks of the outbox table, each
request a statement of `runtime.sql` on a pooled connection.

Claims take rows `FOR UPDATE SKIP LOCKED`, so processes claiming at once never wait on each
other nor take the same row; every outcome write and lease extension matches id and token;
time is the database's clock (`now()`), the same for every process. The statements' own
comments say what each does row by row; `storage` says what the runtime may rely on.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import datetime
from typing import Any

from ..breaker import Breaker
from ..errors import DatabaseError
from ..limits import BURST_LEAST, BURST_SECONDS, ROOM_POLL, Limits, Rate, allowance
from ..message import Message
from ..queries import Queries
from ..storage import CONTROL_PREFIX, Allowed, Claim, QueueControl, Tripped, Write, release
from .boundary import boundary
from .claims import SET_ASIDE_TOKEN, send_claim, send_fair_claim
from .outcomes import PipelineFlush, params, statement
from .pool import Keeper, Pool, pooled


class PostgresStore:
    """The outbox table of `queries` through `pool` (a `storage.Store`)."""

    def __init__(self, pool: Pool, queries: Queries) -> None:
        self.pool = pool
        self.queries = queries
        # The fetchers' statements (claims, looks for the next due row): each queue's on the
        # connection its last claim kept (`Claim.keep`), if any; a look gives it back, as
        # its fetcher's rest does (`rest`).
        self._fetching = Keeper(pool)

    @property
    def has_dlq(self) -> bool:
        return self.queries.names.dlq is not None

    async def claim(self, claim: Claim) -> list[Message]:
        with boundary():
            async with self._fetching.use(claim.queue, keep=claim.keep) as conn:
                return await (await send_claim(conn, self.queries, claim)).fetchall()

    async def claim_limited(self, claim: Claim) -> Allowed:
        """One transaction: lock the queue's row of `outbox_farm_queues` (claims of the queue
        take turns, on every host), read what its limits allow with a snapshot taken after the
        lock (so every claim before it counts), claim that many, and write back what is left
        of the rate's bucket. See `limit_allowance`. A queue with a per-key running limit is
        claimed by `claim_fair`, within the same transaction."""
        key = self._control_key(claim.queue)
        want = claim.limit or 0
        args = {
            **key,
            "aside": SET_ASIDE_TOKEN,
            "burst_seconds": BURST_SECONDS,
            "burst_least": BURST_LEAST,
        }
        with boundary():
            async with self._fetching.use(claim.queue, keep=claim.keep) as conn, conn.transaction():
                await conn.execute(self.queries["limit_lock"], key)
                found = await (await conn.execute(self.queries["limit_allowance"], args)).fetchone()
                if found is None:  # the controls' row is gone: nothing limits the queue
                    allowed, wait, tokens, at, key_max = want, 0.0, None, None, None
                else:
                    tokens, per_second, size, at, room, key_max = found
                    allowed, wait = allowance(
                        want, tokens=tokens, per_second=per_second, size=size, room=room
                    )
                if not allowed:
                    return Allowed([], 0, wait)
                limited = replace(claim, limit=allowed)
                if key_max is None:
                    cursor = await send_claim(conn, self.queries, limited)
                else:
                    cursor = await send_fair_claim(conn, self.queries, limited, key_max)
                messages = await cursor.fetchall()
                if key_max is not None and len(messages) < allowed:
                    # Every key with rows waiting may be at its limit (or none waits): said as
                    # a claim held back, so the fetcher asks again after a short poll (or at a
                    # NOTIFY) instead of at once for rows that are due but not its to take.
                    allowed, wait = len(messages), max(wait, ROOM_POLL)
                if tokens is not None:
                    left = {**key, "left": tokens - len(messages), "at": at}
                    await conn.execute(self.queries["limit_spend"], left)
        return Allowed(messages, allowed, wait)

    async def breaker_failed(
        self, queue: str, breaker: Breaker, reason: str, *, down: bool
    ) -> tuple[bool, bool]:
        """Under the queue's row lock (`breaker_failed`), so the count is exact across hosts."""
        args = {
            **self._control_key(queue),
            "threshold": breaker.failures,
            "every": breaker.probe_every,
            "reason": reason,
            "down": down,
            "payload": CONTROL_PREFIX + queue,
        }
        found = await self._one("breaker_failed", args)
        return (bool(found[0]), bool(found[1])) if found is not None else (False, False)

    async def breaker_reset(self, queue: str) -> None:
        await self._one("breaker_reset", self._control_key(queue))

    async def breaker_probe(self, queue: str, every: float) -> bool:
        return (
            await self._one("breaker_probe", {**self._control_key(queue), "every": every})
            is not None
        )

    async def breaker_close(self, queue: str) -> bool:
        args = {**self._control_key(queue), "payload": CONTROL_PREFIX + queue}
        found = await self._one("breaker_close", args)
        return bool(found and found[0])

    def _control_key(self, queue: str) -> dict[str, Any]:
        """The key of `queue`'s row of `outbox_farm_queues`."""
        return {"target": str(self.queries.names.outbox), "queue": queue}

    async def _one(self, name: str, args: dict[str, Any]) -> Any:
        """The statement `name` on a pooled connection: its first row, None when it has none
        (or returns no rows at all)."""
        with boundary():
            async with pooled(self.pool) as conn:
                cursor = await conn.execute(self.queries[name], args)
                return await cursor.fetchone() if cursor.description is not None else None

    async def next_due(self, queue: str) -> float | None:
        """On the database clock."""
        with boundary():
            async with self._fetching.use(queue) as conn:
                cursor = await conn.execute(self.queries["next_due"], {"queue": queue})
                row = await cursor.fetchone()
        return None if row is None or row[0] is None else float(row[0])

    async def rest(self, queue: str) -> None:
        await self._fetching.give_back(queue)

    async def free_stranded(self, queue: str) -> int:
        """The rows marked `key_blocked` with nothing left before them in their key (see the
        statement): rare, so the fetcher looks every few seconds, not on every claim."""
        with boundary():
            async with self._fetching.use(queue) as conn:
                cursor = await conn.execute(self.queries["free_stranded"], {"queue": queue})
                row = await cursor.fetchone()
        return 0 if row is None else int(row[0])

    async def set_aside(self, ids: list[int], token: uuid.UUID, seconds: float) -> list[int]:
        """Under `SET_ASIDE_TOKEN`, which only the lease's expiry frees."""
        args = {"ids": ids, "token": token, "aside": SET_ASIDE_TOKEN, "seconds": seconds}
        with boundary():
            async with pooled(self.pool) as conn:
                cursor = await conn.execute(self.queries["set_aside"], args)
                return [row[0] for row in await cursor.fetchall()]

    async def give_back(self, ids: list[int], token: uuid.UUID) -> None:
        await self._execute(release(ids, [token] * len(ids)))

    async def extend_leases(
        self, ids: list[int], tokens: list[uuid.UUID], lease_ttl: float
    ) -> set[int]:
        """To `lease_ttl` seconds past the database's now()."""
        args = {"ids": ids, "tokens": tokens, "lease_ttl": lease_ttl}
        with boundary():
            async with pooled(self.pool) as conn:
                cursor = await conn.execute(self.queries["extend_leases"], args)
                return {row[0] for row in await cursor.fetchall()}

    @asynccontextmanager
    async def flush(self, *, single: bool = False) -> AsyncIterator[PipelineFlush]:
        """A pooled connection in pipeline mode for one flush (see `outcomes`); `single`: the
        flush is one write, sent without pipeline mode, whose entry and closing sync would
        cost it another round trip. `ConnectionLost` also when the last sync fails as the
        block ends."""
        with boundary():
            async with pooled(self.pool) as conn:
                if single:
                    yield PipelineFlush(self.pool, self.queries, conn, None)
                    return
                async with conn.pipeline() as pipe:
                    yield PipelineFlush(self.pool, self.queries, conn, pipe)

    async def refusal(self, write: Write) -> DatabaseError | None:
        """`write` run over no rows: it changes nothing and locks nothing, yet the server checks
        the privileges of every table it names and refuses it in a read-only transaction, as
        for any row."""
        try:
            await self._execute(write)
        except DatabaseError as exc:
            return exc
        return None

    async def controls(self) -> dict[str, QueueControl]:
        """From `outbox_farm_queues` (migration 0011), on the database clock."""
        target = str(self.queries.names.outbox)
        with boundary():
            async with pooled(self.pool) as conn:
                cursor = await conn.execute(self.queries["control_load"], {"target": target})
                rows = await cursor.fetchall()
        return {row[0]: _control(*row) for row in rows}

    async def _execute(self, write: Write) -> None:
        """`write` alone, on a pooled connection, its result unread."""
        with boundary():
            async with pooled(self.pool) as conn:
                await conn.execute(self.queries[statement(write)], params(write))


def _control(
    queue: str,
    paused: bool,
    until: datetime | None,
    reason: str | None,
    rate_count: int | None,
    rate_seconds: float | None,
    max_running: int | None,
    failures: int,
    open_since: datetime | None,
    probe_in: float | None,
    why: str | None,
    key_max_running: int | None,
) -> QueueControl:
    """A row of `control_load` as the farm sees it."""
    rate = Rate(rate_count, rate_seconds) if rate_count and rate_seconds else None
    limits = Limits(rate, max_running, key_max_running)
    if not paused:
        until, reason = None, None
    tripped = None if open_since is None else Tripped(open_since, probe_in or 0.0, why)
    return QueueControl(queue, paused, until, reason, limits, tripped, failures)
