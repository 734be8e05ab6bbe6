"""The completer's writes: lease-guarded, set-based statements, one flush through one pipeline.

A `Write` describes one statement over many rows (`ack`, `retry`, `release`, `dead_letter`);
`Flush.send` runs it and says which of its rows it matched (by position), so a caller can tell
a row written from one whose lease another runner holds. A write is a description rather than a call
because it may be sent more than once: after a lost connection the caller opens a new flush
and sends again what was left.

Statements of one flush share a connection in pipeline mode, with a sync after each: the
statements between two syncs would share one implicit transaction, and a refused DLQ move must
not roll back the acks beside it. A statement refused as a whole is sent again row by row on
other connections, so one bad row stays alone (`Written.refused`). A write sent again after a
lost connection may find its rows gone because its first attempt committed before the reply
was lost; the rows it did not match are then looked up, and those gone or free are
`Written.unconfirmed` rather than lost to another lease.

An ack may carry a hand-over (`Flush.send`): sent as `ack_next`, it also claims the next row of
each key it deletes a row of, for the fetcher. A flush that is that one statement goes without
pipeline mode (`pipeline(single=True)`), a round trip sooner.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg

from ..errors import ConnectionLost, DatabaseError
from ..queries import Queries
from .boundary import DRIVER_ERRORS, boundary, translate
from .claims import ClaimedRow, Request, handed_over, send_claim
from .pool import Pool


@dataclass(slots=True)
class Write:
    """One statement over the rows `ids` (parallel to `tokens` and to each of `columns`).

    `resent` is set by `Flush.send` when the write was in flight as its connection broke.
    """

    statement: str
    ids: list[int]
    tokens: list[uuid.UUID]
    columns: dict[str, list[Any]] = field(default_factory=dict)
    resent: bool = False

    def params(self) -> dict[str, Any]:
        """The statement's arguments: each row's token as a position (from 1) in the list of
        the write's distinct tokens (found by identity: a claim's rows share one object, and
        an equal token twice in the list would still match)."""
        tokens: list[uuid.UUID] = []
        slot_of: dict[int, int] = {}
        slots: list[int] = []
        for token in self.tokens:
            slot = slot_of.get(id(token))
            if slot is None:
                tokens.append(token)
                slot = slot_of[id(token)] = len(tokens)
            slots.append(slot)
        return {
            "ids": _int_array(self.ids),
            "slots": _int_array(slots),
            "tokens": tokens,
            **self.columns,
        }

    def row(self, index: int) -> Write:
        """The same statement for the one row at `index`."""
        one = slice(index, index + 1)
        columns = {name: values[one] for name, values in self.columns.items()}
        return Write(self.statement, self.ids[one], self.tokens[one], columns)


def _int_array(values: list[int]) -> str:
    """An array of integers as its text literal: joined in C, where a binary array would be
    dumped element by element in Python (two elements per row of every flush)."""
    return "{" + ",".join(map(str, values)) + "}"


def ack(ids: list[int], tokens: list[uuid.UUID]) -> Write:
    """Delete the rows: their handlers succeeded (or they failed for good, with no DLQ)."""
    return Write("ack", ids, tokens)


def retry(
    ids: list[int],
    tokens: list[uuid.UUID],
    *,
    delays: list[float],
    ran: list[bool],
    started: list[datetime | None],
) -> Write:
    """Free the rows' leases and make them due `delays` seconds after the write (database
    clock); a row whose handler `ran` (from `started`) counts an attempt."""
    columns: dict[str, list[Any]] = {
        "delays": delays,
        "ran": [int(r) for r in ran],
        "started": started,
    }
    return Write("retry", ids, tokens, columns)


def release(ids: list[int], tokens: list[uuid.UUID]) -> Write:
    """Free the rows' leases and take back the delivery their claim counted: never started."""
    return Write("release", ids, tokens)


def dead_letter(
    ids: list[int],
    tokens: list[uuid.UUID],
    *,
    reasons: list[str],
    exceptions: list[str | None],
) -> Write:
    """Move the rows to the DLQ in one statement (needs a DLQ table): archived and deleted
    together, or (the archive refused) neither."""
    return Write("dlq_move", ids, tokens, {"reasons": reasons, "exceptions": exceptions})


@dataclass(frozen=True, slots=True)
class Written:
    """What one write did, its rows named by their positions in the write (from 0).
    `matched`: the rows written. Of the others, `refused` were refused by the database (each
    tried alone), `unconfirmed` were found gone or free after a resend, and the rest are held
    under another token or gone."""

    matched: set[int]
    unconfirmed: set[int] = field(default_factory=set)
    refused: dict[int, DatabaseError] = field(default_factory=dict)
    claimed: list[ClaimedRow] = field(default_factory=list)
    """What the claim sent with the write took (its hand-over, see `Flush.send`)."""


class Flush:
    """One connection, in pipeline mode unless the flush is a single write, for the writes of
    one flush; see `pipeline()`."""

    def __init__(
        self,
        pool: Pool,
        queries: Queries,
        conn: psycopg.AsyncConnection[Any],
        pipe: psycopg.AsyncPipeline | None,
    ) -> None:
        self._pool = pool
        self._queries = queries
        self._conn = conn
        self._pipe = pipe

    async def send(self, write: Write, handover: Request | None = None) -> Written:
        """Run `write` and sync. Raises `ConnectionLost` when the connection broke (then the
        flush is over: open another and send the write again); any other error of the
        statement is in the result, row by row.

        `handover` (an `ack` only): the ack runs as `ack_next`, which also claims the next row
        of each key it deletes a row of (`Written.claimed`). Refused, it takes the ack with it:
        the ack's rows are then sent again alone, as plain acks, and nothing is claimed."""
        conn = self._conn
        try:
            if handover is None:
                cursor = conn.cursor()
                await cursor.execute(self._queries[write.statement], write.params())
            else:
                cursor = await send_claim(conn, self._queries, handover, write.params())
            if self._pipe is not None:
                await self._pipe.sync()
            rows = await cursor.fetchall()
            if handover is None:
                matched = {row[0] for row in rows}
            else:
                matched = set(rows[0][0] or ()) if rows else set()
                claimed = handed_over(cursor, rows)
        except DRIVER_ERRORS as exc:
            # The session's end (57P01, say) may be read before libpq sees the socket close.
            error = translate(exc, lost=conn.broken or conn.closed)
            if isinstance(error, ConnectionLost):
                write.resent = True
                raise error from exc
            return await self._isolate(write, error)
        if write.resent:
            return Written(matched, await self._unconfirmed(write, matched))
        return Written(matched) if handover is None else Written(matched, claimed=claimed)

    async def _unconfirmed(self, write: Write, matched: set[int]) -> set[int]:
        """Of the rows a resent write did not match, those gone or free: the first attempt
        most likely wrote them. The rest are held under another token."""
        missed = [n for n in range(len(write.ids)) if n not in matched]
        if not missed:
            return set()
        with boundary():
            cursor = self._conn.cursor()
            await cursor.execute(
                self._queries["lease_holders"], {"ids": [write.ids[n] for n in missed]}
            )
            if self._pipe is not None:
                await self._pipe.sync()
            held = {row[0] for row in await cursor.fetchall() if row[1] is not None}
        return {n for n in missed if write.ids[n] not in held}

    async def _isolate(self, write: Write, error: DatabaseError) -> Written:
        """The statement was refused as a whole: each row alone, on a pooled connection."""
        if len(write.ids) == 1:
            return Written(set(), refused={0: error})
        matched: set[int] = set()
        refused: dict[int, DatabaseError] = {}
        for index in range(len(write.ids)):
            single = write.row(index)
            query = self._queries[single.statement]
            try:
                with boundary():
                    async with self._pool.connection() as conn:
                        cursor = await conn.execute(query, single.params())
                        if await cursor.fetchall():
                            matched.add(index)
            except DatabaseError as row_error:
                refused[index] = row_error
        return Written(matched, refused=refused)


async def give_back(pool: Pool, queries: Queries, ids: list[int], token: uuid.UUID) -> None:
    """Release rows claimed under `token` that will not be handed to a handler (a claim that
    came back after the stop began): their leases cleared and their deliveries taken back, at
    once, on a pooled connection."""
    write = release(ids, [token] * len(ids))
    with boundary():
        async with pool.connection() as conn:
            await conn.execute(queries[write.statement], write.params())


@asynccontextmanager
async def pipeline(pool: Pool, queries: Queries, *, single: bool = False) -> AsyncIterator[Flush]:
    """A pooled connection in pipeline mode for one flush. Raises `ConnectionLost` when no
    connection can be had, or when the last sync fails as the block ends.

    `single`: the flush is one statement: sent as it is, without pipeline mode, whose entry
    and closing sync cost a single write another round trip."""
    with boundary():
        async with pool.connection() as conn:
            if single:
                yield Flush(pool, queries, conn, None)
                return
            async with conn.pipeline() as pipe:
                yield Flush(pool, queries, conn, pipe)
