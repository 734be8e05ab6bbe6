"""The completer's writes: lease-guarded, set-based statements, one flush through one pipeline.

A `storage.Write` describes one statement over many rows (its `kind` names the statement);
`PipelineFlush.send` runs it and says which of its rows it matched (by position), so a caller
can tell a row written from one whose lease another runner holds.

Statements of one flush share a connection in pipeline mode, with a sync after each: the
statements between two syncs would share one implicit transaction, and a refused DLQ move must
not roll back the acks beside it. A statement refused as a whole is sent again row by row on
other connections, so one bad row stays alone (`Written.refused`). A write sent again after a
lost connection may find its rows gone because its first attempt committed before the reply
was lost; the rows it did not match are then looked up, and those gone or free are
`Written.unconfirmed` rather than lost to another lease.

An ack may carry a hand-over (`PipelineFlush.send`): sent as `ack_next`, it also claims the
next row of each key it deletes a row of, for the fetcher. A flush that is that one statement
goes without pipeline mode (`PostgresStore.flush(single=True)`), a round trip sooner.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg

from ..errors import ConnectionLost, DatabaseError
from ..message import Message
from ..queries import Queries
from ..storage import Claim, Write, Written
from .boundary import DRIVER_ERRORS, boundary, translate
from .claims import send_handover
from .pool import Pool, pooled

_STATEMENTS = {"ack": "ack", "retry": "retry", "release": "release", "dlq_move": "dlq_move"}
"""The statement of each kind of `Write`."""


def statement(write: Write) -> str:
    return _STATEMENTS[write.kind]


def params(write: Write) -> dict[str, Any]:
    """The statement's arguments: each row's token as a position (from 1) in the list of the
    write's distinct tokens (found by identity: a claim's rows share one object, and an equal
    token twice in the list would still match)."""
    tokens: list[uuid.UUID] = []
    slot_of: dict[int, int] = {}
    slots: list[int] = []
    for token in write.tokens:
        slot = slot_of.get(id(token))
        if slot is None:
            tokens.append(token)
            slot = slot_of[id(token)] = len(tokens)
        slots.append(slot)
    columns = write.columns
    if "ran" in columns:  # bound as integers, the attempts they add
        columns = {**columns, "ran": [int(ran) for ran in columns["ran"]]}
    return {"ids": _int_array(write.ids), "slots": _int_array(slots), "tokens": tokens, **columns}


def _int_array(values: list[int]) -> str:
    """An array of integers as its text literal: joined in C, where a binary array would be
    dumped element by element in Python (two elements per row of every flush)."""
    return "{" + ",".join(map(str, values)) + "}"


class PipelineFlush:
    """One connection, in pipeline mode unless the flush is a single write, for the writes of
    one flush (a `storage.Flush`; see `PostgresStore.flush`)."""

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

    async def send(self, write: Write, handover: Claim | None = None) -> Written:
        """Run `write` and sync (see `storage.Flush.send`). `handover`: the ack runs as
        `ack_next`, which also claims the next row of each key it deletes a row of. Refused,
        it takes the ack with it: the ack's rows are then sent again alone, as plain acks, and
        nothing is claimed."""
        conn = self._conn
        claimed: list[Message] = []
        try:
            if handover is None:
                cursor = conn.cursor()
                await cursor.execute(self._queries[statement(write)], params(write))
                await self._sync()
                matched = {row[0] for row in await cursor.fetchall()}
            else:
                handing = await send_handover(conn, self._queries, handover, params(write))
                await self._sync()
                rows = await handing.fetchall()
                matched = set(rows[0][0] or ()) if rows else set()
                claimed = [msg for _, msg in rows if msg is not None]
        except DRIVER_ERRORS as exc:
            # The session's end (57P01, say) may be read before libpq sees the socket close.
            error = translate(exc, lost=conn.broken or conn.closed)
            if isinstance(error, ConnectionLost):
                write.resent = True
                raise error from exc
            return await self._isolate(write, error)
        if write.resent:
            return Written(matched, await self._unconfirmed(write, matched))
        return Written(matched, claimed=claimed)

    async def _sync(self) -> None:
        if self._pipe is not None:
            await self._pipe.sync()

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
            await self._sync()
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
            query = self._queries[statement(single)]
            try:
                with boundary():
                    async with pooled(self._pool) as conn:
                        cursor = await conn.execute(query, params(single))
                        if await cursor.fetchall():
                            matched.add(index)
            except DatabaseError as row_error:
                refused[index] = row_error
        return Written(matched, refused=refused)
