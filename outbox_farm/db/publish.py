"""The producer's statements, run on the caller's connection inside the caller's transaction.

Nothing here commits, opens a transaction or takes a connection: the row, and the NOTIFY that
Postgres delivers only at commit, share the fate of the caller's own writes. Each call is one
statement and one round trip (a connection's first, two: see below). The statements are those
of `queries/producer.sql`, composed once per `Queries`; the arguments arrive validated and
encoded by `outbox_farm.producer`.

Upgrades in either order: a table that has not had migration 0008 has no `key_blocked`, and a
row that names it would fail the caller's own transaction. So the producer asks the catalog, on
a connection's first publish, whether the column is there, and writes the rows that schema
accepts (without the mark: unmarked keyed rows are only claimed the slower way). The answer is
kept per connection object (a weak map: a pool's connections are asked once each, a closed one
is forgotten): one more round trip on a connection's first publish, a weak-map lookup on every
other. A connection that found no column asks again every `RECHECK` seconds, so producers that
outlive the migration start marking rows soon after it.

Migration 0013's `priority` is written only for a row published with a priority above 0 (0 is
the column's default): every other row is written by the statement of the release before, on
any schema, at the cost it had. A row with a priority on a table without the column is refused
before anything is sent, saying to run `outbox-farm migrate`, so the caller's transaction is
not aborted by it; the catalog is asked again before each such refusal, so the first publish
after the migration is accepted.

Migration 0014's `fair_key` is written the same way: only for a row published with a fair key,
by statements that write every column of this release (a table with `fair_key` has had 0008
and 0013 too), refused with the same advice on a table without the column.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any, NamedTuple
from weakref import WeakKeyDictionary

import psycopg
from psycopg import sql

from ..errors import DatabaseError, SchemaError
from ..names import TableNames
from ..queries import Queries, compose, load_blocks
from .boundary import translate
from .connect import AsyncConnection, Connection

WRITE_FAILED = "outbox write failed"
# The statements that write rows, and the fragments of them that write `key_blocked`.
WRITES = ("publish", "publish_timer", "publish_extend", "publish_batch")
MARKING = ("key_blocked_column", "key_blocked_at_publish", "key_blocked_in_batch")
# The fragments that write `priority` (migration 0013), only for a row of priority above 0.
RANKING = ("priority_column", "priority_value", "priority_extend")
# The fragments that write `fair_key` (migration 0014), only for a row with a fair key.
FAIR = ("fair_column", "fair_value", "fair_extend")
RECHECK = 30.0  # seconds a connection that found no `key_blocked` writes rows without it
NO_PRIORITY = (
    "the outbox table {table} has no priority column yet (migration 0013): run "
    "`outbox-farm migrate`, or publish without a priority until then"
)
NO_FAIR_KEY = (
    "the outbox table {table} has no fair_key column yet (migration 0014): run "
    "`outbox-farm migrate`, or publish without a fair_key until then"
)


def without(names: TableNames, fragments: tuple[str, ...]) -> dict[str, str]:
    """The write statements with `fragments` left out; the other fragments filled in."""
    blocks = load_blocks()
    filled = {
        fragment: sql.SQL(compose(blocks[fragment], names)) for fragment in MARKING + RANKING + FAIR
    }
    omitted = {fragment: sql.SQL("") for fragment in fragments}
    return {
        name: sql.SQL(blocks[name])
        .format(**names.identifiers(), **{**filled, **omitted})
        .as_string(None)
        for name in WRITES
    }


def unmarked(names: TableNames) -> dict[str, str]:
    """The write statements for a table without `key_blocked` (before migration 0008): the
    same blocks with the fragments that write the column (and `priority`, `fair_key`) left
    out."""
    return without(names, MARKING + RANKING + FAIR)


class _Found(NamedTuple):
    """What a connection's first publish found: the statements its table takes, until when
    (monotonic time; None: for as long as the connection lives)."""

    statements: Mapping[str, str]
    until: float | None
    ranked: Mapping[str, str] | None  # the statements that write `priority`; None: no column
    fair: Mapping[str, str] | None = None  # ... that write `fair_key` too; None: no column


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
    priority: int = 0  # among due rows of the queue, higher first (0 to 32767)
    fair_key: str | None = None  # the tenant, for a queue's per-key running limit


class NewBatch(NamedTuple):
    """Rows of one queue sharing their due time; `headers[i]` and `ordering_keys[i]` belong to
    `payloads[i]` (`ordering_keys` None: no row has a key)."""

    queue: str
    payloads: list[bytes]
    headers: list[str]
    due: Due
    ordering_keys: list[str | None] | None = None
    priority: int = 0  # every row's
    fair_key: str | None = None  # every row's


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
        self._current = without(queries.names, RANKING + FAIR)
        self._older = unmarked(queries.names)
        self._ranked = without(queries.names, FAIR)
        self._ranked_older = without(queries.names, MARKING + FAIR)
        self._fair = {name: queries[name] for name in WRITES}
        self._schema_query = queries["publish_schema"]
        self._ask = {"table": queries.names.outbox.identifier().as_string(None)}
        # Written and read by every thread or task that publishes through this producer, each
        # with its own connection; the GIL makes each get and set atomic.
        self._found: WeakKeyDictionary[Connection | AsyncConnection, _Found] = WeakKeyDictionary()

    def _fail(self, exc: psycopg.Error) -> DatabaseError:
        return translate(exc, doing=WRITE_FAILED, names=self._names)

    def _known(self, conn: Connection | AsyncConnection) -> _Found | None:
        """What this connection's table takes, when known and not due a new look."""
        found = self._found.get(conn)
        if found is None or (found.until is not None and found.until < time.monotonic()):
            return None
        return found

    def _remember(self, conn: Connection | AsyncConnection, row: tuple[Any, ...] | None) -> _Found:
        if row is None:  # no table: the write fails as it always did, saying to migrate
            return _Found(self._current, None, self._ranked, self._fair)
        marked, ranked, fair = row
        if marked:
            found = _Found(
                self._current,
                None,
                self._ranked if ranked else None,
                self._fair if fair else None,
            )
        else:
            older = self._ranked_older if ranked else None
            found = _Found(self._older, time.monotonic() + RECHECK, older)
        self._found[conn] = found
        return found

    def _choose(self, found: _Found, priority: int, fair: bool) -> Mapping[str, str]:
        """The statements for a row of `priority`: those that write it only when above 0; for
        a row with a fair key (`fair`), those that write every column."""
        if fair:
            if found.fair is None:
                raise SchemaError(NO_FAIR_KEY.format(table=self._names.outbox))
            return found.fair
        if not priority:
            return found.statements
        if found.ranked is None:
            raise SchemaError(NO_PRIORITY.format(table=self._names.outbox))
        return found.ranked

    @staticmethod
    def _stale(known: _Found | None, priority: int, fair: bool) -> bool:
        """Whether to ask the catalog first: not asked yet, or a column this row needs was
        missing when last asked (a migration may have run since)."""
        return (
            known is None
            or (priority > 0 and known.ranked is None)
            or (fair and known.fair is None)
        )

    def _statements(
        self, conn: Connection, priority: int = 0, fair: bool = False
    ) -> Mapping[str, str]:
        known = self._known(conn)
        if known is None or self._stale(known, priority, fair):
            known = self._remember(conn, conn.execute(self._schema_query, self._ask).fetchone())
        return self._choose(known, priority, fair)

    async def _astatements(
        self, conn: AsyncConnection, priority: int = 0, fair: bool = False
    ) -> Mapping[str, str]:
        known = self._known(conn)
        if known is None or self._stale(known, priority, fair):
            cursor = await conn.execute(self._schema_query, self._ask)
            known = self._remember(conn, await cursor.fetchone())
        return self._choose(known, priority, fair)

    def _one(
        self, statements: Mapping[str, str], row: NewRow, notify: bool
    ) -> tuple[str, dict[str, Any]]:
        if row.timer_id is None:
            name = "publish"
        else:
            name = "publish_extend" if row.extend_timer else "publish_timer"
        return statements[name], {
            "queue": row.queue,
            "payload": row.payload,
            "headers": row.headers,
            "at": row.due.at,
            "delay": row.due.delay,
            "timer_id": row.timer_id,
            "ordering_key": row.ordering_key,
            "priority": row.priority,
            "fair_key": row.fair_key,
            "notify": notify,
            "channel": self._channel,
        }

    def _batch(
        self, statements: Mapping[str, str], batch: NewBatch, notify: bool
    ) -> tuple[str, dict[str, Any]]:
        return statements["publish_batch"], {
            "queue": batch.queue,
            "payloads": batch.payloads,
            "headers": batch.headers,
            "ordering_keys": batch.ordering_keys,
            "priority": batch.priority,
            "fair_key": batch.fair_key,
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
        try:
            query, params = self._one(
                self._statements(conn, row.priority, row.fair_key is not None), row, notify
            )
            found = conn.execute(query, params).fetchone()
        except psycopg.Error as exc:
            raise self._fail(exc) from exc
        return int(found[0]) if found else None

    async def ainsert(self, conn: AsyncConnection, row: NewRow, *, notify: bool) -> int | None:
        try:
            query, params = self._one(
                await self._astatements(conn, row.priority, row.fair_key is not None), row, notify
            )
            found = await (await conn.execute(query, params)).fetchone()
        except psycopg.Error as exc:
            raise self._fail(exc) from exc
        return int(found[0]) if found else None

    def insert_batch(self, conn: Connection, batch: NewBatch, *, notify: bool) -> list[int]:
        """The new rows' ids, in the order of `batch.payloads`; at most one NOTIFY in all."""
        if not batch.payloads:
            return []
        try:
            query, params = self._batch(
                self._statements(conn, batch.priority, batch.fair_key is not None), batch, notify
            )
            return [int(r[0]) for r in conn.execute(query, params).fetchall()]
        except psycopg.Error as exc:
            raise self._fail(exc) from exc

    async def ainsert_batch(
        self, conn: AsyncConnection, batch: NewBatch, *, notify: bool
    ) -> list[int]:
        if not batch.payloads:
            return []
        try:
            query, params = self._batch(
                await self._astatements(conn, batch.priority, batch.fair_key is not None),
                batch,
                notify,
            )
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
