"""The producer's statements, run on the caller's connection inside the caller's transaction.

Nothing here commits, opens a transaction or takes a connection: the row, and the NOTIFY that
Postgres delivers only at commit, share the fate of the caller's own writes. Each call is one
statement and one round trip. The statements are those of `queries/producer.sql`, composed
once per `Queries`; the arguments arrive validated and encoded by `outbox_farm.producer`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, NamedTuple

import psycopg

from ..errors import DatabaseError
from ..queries import Queries
from .boundary import translate
from .connect import AsyncConnection, Connection

WRITE_FAILED = "outbox write failed"


class Due(NamedTuple):
    """When rows become due: at `at` when given, else `delay` seconds after the database's
    now() (its clock, not this machine's)."""

    at: datetime | None
    delay: float


class NewRow(NamedTuple):
    """One row to publish; `headers` is the JSON text, `timer_id` makes it a timer."""

    queue: str
    payload: bytes
    headers: str
    due: Due
    timer_id: str | None = None
    extend_timer: bool = False  # a live timer with this id: move it (True) or keep it
    ordering_key: str | None = None  # rows of one queue and key run one at a time, in id order


class NewBatch(NamedTuple):
    """Rows of one queue sharing their due time; `headers[i]` and `ordering_keys[i]` belong to
    `payloads[i]` (`ordering_keys` None: no row has a key)."""

    queue: str
    payloads: list[bytes]
    headers: list[str]
    due: Due
    ordering_keys: list[str | None] | None = None


class Publisher:
    """The publish statements of one outbox table.

    Every error is raised as an outbox_farm error: a missing outbox table is a `SchemaError`
    that says to run `outbox-farm migrate`; anything else a `DatabaseError` ("outbox write
    failed"). Both are also `psycopg.Error`s, and the caller's transaction is then aborted,
    as after any failed statement.
    """

    def __init__(self, queries: Queries) -> None:
        self._queries = queries
        self._names = queries.names
        self._channel = queries.names.channel

    def _fail(self, exc: psycopg.Error) -> DatabaseError:
        return translate(exc, doing=WRITE_FAILED, names=self._names)

    def _one(self, row: NewRow, notify: bool) -> tuple[str, dict[str, Any]]:
        if row.timer_id is None:
            name = "publish"
        else:
            name = "publish_extend" if row.extend_timer else "publish_timer"
        return self._queries[name], {
            "queue": row.queue,
            "payload": row.payload,
            "headers": row.headers,
            "at": row.due.at,
            "delay": row.due.delay,
            "timer_id": row.timer_id,
            "ordering_key": row.ordering_key,
            "notify": notify,
            "channel": self._channel,
        }

    def _batch(self, batch: NewBatch, notify: bool) -> tuple[str, dict[str, Any]]:
        return self._queries["publish_batch"], {
            "queue": batch.queue,
            "payloads": batch.payloads,
            "headers": batch.headers,
            "ordering_keys": batch.ordering_keys,
            "at": batch.due.at,
            "delay": batch.due.delay,
            "notify": notify,
            "channel": self._channel,
        }

    def _cancel(self, queue: str, timer_id: str) -> tuple[str, dict[str, Any]]:
        return self._queries["cancel_timer"], {"queue": queue, "timer_id": timer_id}

    # Sync and async pairs over the same builders: they differ only in how the statement is
    # awaited.

    def insert(self, conn: Connection, row: NewRow, *, notify: bool) -> int | None:
        """The new row's id; None when a timer of that id exists and was kept, or is running
        and could not be moved. `notify`: wake the farm (only when the row is due now)."""
        query, params = self._one(row, notify)
        try:
            found = conn.execute(query, params).fetchone()
        except psycopg.Error as exc:
            raise self._fail(exc) from exc
        return int(found[0]) if found else None

    async def ainsert(self, conn: AsyncConnection, row: NewRow, *, notify: bool) -> int | None:
        query, params = self._one(row, notify)
        try:
            found = await (await conn.execute(query, params)).fetchone()
        except psycopg.Error as exc:
            raise self._fail(exc) from exc
        return int(found[0]) if found else None

    def insert_batch(self, conn: Connection, batch: NewBatch, *, notify: bool) -> list[int]:
        """The new rows' ids, in the order of `batch.payloads`; at most one NOTIFY in all."""
        if not batch.payloads:
            return []
        query, params = self._batch(batch, notify)
        try:
            return [int(r[0]) for r in conn.execute(query, params).fetchall()]
        except psycopg.Error as exc:
            raise self._fail(exc) from exc

    async def ainsert_batch(
        self, conn: AsyncConnection, batch: NewBatch, *, notify: bool
    ) -> list[int]:
        if not batch.payloads:
            return []
        query, params = self._batch(batch, notify)
        try:
            return [int(r[0]) for r in await (await conn.execute(query, params)).fetchall()]
        except psycopg.Error as exc:
            raise self._fail(exc) from exc

    def cancel_timer(self, conn: Connection, queue: str, timer_id: str) -> bool:
        """Delete a timer that is not running; False when there is none to delete."""
        query, params = self._cancel(queue, timer_id)
        try:
            return conn.execute(query, params).fetchone() is not None
        except psycopg.Error as exc:
            raise self._fail(exc) from exc

    async def acancel_timer(self, conn: AsyncConnection, queue: str, timer_id: str) -> bool:
        query, params = self._cancel(queue, timer_id)
        try:
            return await (await conn.execute(query, params)).fetchone() is not None
        except psycopg.Error as exc:
            raise self._fail(exc) from exc
