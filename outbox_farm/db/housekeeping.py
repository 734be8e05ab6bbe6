"""Table-wide reads and chores one process of a farm runs: the database-derived gauges, the
VACUUM of the outbox table and its shrink after a backlog, the DLQ retention."""

from __future__ import annotations

from typing import Any, NamedTuple

import psycopg
from psycopg import sql

from ..errors import SchemaError
from ..queries import Queries, load_blocks
from .boundary import boundary
from .operator import XminHolder
from .pool import Pool, pooled

LOCK_NOT_AVAILABLE = "55P03"  # VACUUM (SKIP_LOCKED) warns with it when someone else holds it


class QueueBacklog(NamedTuple):
    """One queue's rows in the outbox, and the age of its oldest due row nobody holds."""

    queue: str
    rows: int
    oldest_pending_age: float


class DlqCount(NamedTuple):
    queue: str
    reason: str
    rows: int


class VacuumState(NamedTuple):
    """`allowed`: this role may vacuum the table. `dead_rows`: dead row versions counted.
    `since_vacuum`: seconds since anyone vacuumed it (None: never). `counted`: the server
    keeps those statistics at all (track_counts)."""

    allowed: bool
    dead_rows: int
    since_vacuum: float | None
    counted: bool


class Vacuumed(NamedTuple):
    """`skipped`: someone else held the table (SKIP_LOCKED). `warnings`: the server's other
    warnings, to pass on."""

    skipped: bool
    warnings: list[str]


async def scanning(pool: Pool, statement: str) -> list[Any]:
    """The rows of `statement`, which counts a whole table, on a pooled connection in a
    transaction of its own that allows the sequential scan the farm's sessions refuse
    (`pool._configure_farm`): a count of every row reads them all, and the table is the
    cheapest way to."""
    with boundary():
        async with pooled(pool) as conn, conn.transaction():
            await conn.execute("SET LOCAL enable_seqscan = on")
            rows: list[Any] = await (await conn.execute(statement)).fetchall()
    return rows


async def backlog(pool: Pool, queries: Queries) -> list[QueueBacklog]:
    """One entry per queue that has rows; queues without rows are missing."""
    rows = await scanning(pool, queries["gauges"])
    return [QueueBacklog(queue, int(count), float(age)) for queue, count, age in rows]


async def xmin_holders(pool: Pool, queries: Queries) -> list[XminHolder]:
    """The oldest session, prepared transaction or replication slot holding back this
    database's xmin horizon (what `doctor` reports): one, or none."""
    with boundary():
        async with pooled(pool) as conn:
            rows = await (await conn.execute(queries["admin_xmin_holder"])).fetchall()
    return [XminHolder(*row) for row in rows]


async def dlq_counts(pool: Pool, queries: Queries) -> list[DlqCount]:
    """One entry per queue and failure reason that have DLQ rows (needs a DLQ table)."""
    rows = await scanning(pool, queries["dlq_gauges"])
    return [DlqCount(queue, reason, int(count)) for queue, reason, count in rows]


async def dlq_signature(pool: Pool, queries: Queries) -> tuple[int, int] | None:
    """What changes whenever the DLQ's rows may have (`dlq_signature` in the SQL); None when
    it cannot tell: no statistics kept, or no table (the count then says what is wrong)."""
    assert queries.names.dlq is not None
    table = queries.names.dlq.identifier().as_string(None)
    with boundary():
        async with pooled(pool) as conn:
            cursor = await conn.execute(queries["dlq_signature"], {"table": table})
            row = await cursor.fetchone()
    if row is None or row[1] is None:
        return None
    return int(row[0]), int(row[1])


async def vacuum_state(pool: Pool, queries: Queries) -> VacuumState:
    """What the statistics say about the outbox table; SchemaError when there is none."""
    table = queries.names.outbox.identifier().as_string(None)
    with boundary():
        async with pooled(pool) as conn:
            row = await (await conn.execute(queries["vacuum_state"], {"table": table})).fetchone()
    if row is None:
        raise SchemaError(f"table {table} does not exist")
    allowed, dead, since, counted = row
    return VacuumState(bool(allowed), int(dead), since, bool(counted))


async def vacuum(pool: Pool, queries: Queries) -> Vacuumed:
    """VACUUM the outbox table, never waiting for its lock (SKIP_LOCKED) and never truncating
    it. A role that may not vacuum it only gets warnings: check `vacuum_state` first."""
    with boundary():
        async with pooled(pool) as conn:
            notices = await _vacuum_notices(conn, queries["vacuum"])
    skipped = any(state == LOCK_NOT_AVAILABLE for state, _ in notices)
    return Vacuumed(skipped, [str(message) for state, message in notices if message is not None])


async def _vacuum_notices(
    conn: psycopg.AsyncConnection[Any], statement: str
) -> list[tuple[str | None, str | None]]:
    """Run a VACUUM `statement`; the (sqlstate, message) of each notice it sent: VACUUM says
    what it skipped (a lock not available, a table it may not touch) only as notices."""
    notices: list[tuple[str | None, str | None]] = []

    def collect(diag: psycopg.errors.Diagnostic) -> None:
        notices.append((diag.sqlstate, diag.message_primary))  # valid only in the callback

    conn.add_notice_handler(collect)
    try:
        await conn.execute(statement)
    finally:
        conn.remove_notice_handler(collect)
    return notices


class Relation(NamedTuple):
    """The outbox table or one of its indexes, as `shrink_state` found it. `kind`: `table`,
    `index`, `unique` (a unique index other than the primary key: never rebuilt), or `leftover`
    (an invalid copy a rebuild cut short left behind, this role's to drop)."""

    schema: str
    name: str
    kind: str
    size: int  # bytes
    pages: int


class Shrunk(NamedTuple):
    """What a shrink did. `locked`: another session shrinks the table (nothing was done).
    `vacuum_skipped`: the VACUUM was asked for and did not run, someone holding the table.
    `rebuilt` and `dropped`: the indexes rebuilt, and the leftovers dropped. `failed`: each
    rebuild or drop that could not be done (its index, and why), left for the next shrink."""

    locked: bool
    vacuum_skipped: bool
    rebuilt: list[str]
    dropped: list[str]
    failed: list[tuple[str, str]]


class ShrinkState(NamedTuple):
    """The table (first) and its indexes, and the rows ever inserted into the table by the
    statistics (None: the server keeps none)."""

    relations: list[Relation]
    inserted: int | None


async def shrink_state(pool: Pool, queries: Queries) -> ShrinkState:
    """The outbox table's relations and inserts; SchemaError when there is no table."""
    table = queries.names.outbox.identifier().as_string(None)
    with boundary():
        async with pooled(pool) as conn:
            rows = await (await conn.execute(queries["shrink_state"], {"table": table})).fetchall()
    if not rows:
        raise SchemaError(f"table {table} does not exist")
    inserted = rows[0][5]
    return ShrinkState(
        [Relation(*row[:5]) for row in rows], None if inserted is None else int(inserted)
    )


async def live_rows(pool: Pool, queries: Queries, limit: int) -> int:
    """The outbox table's live rows, counted up to `limit`."""
    with boundary():
        async with pooled(pool) as conn:
            row = await (await conn.execute(queries["shrink_live"], {"limit": limit})).fetchone()
    return int(row[0]) if row else 0


def _on_index(block: str, index: Relation) -> str:
    """The statement `block` for `index`, its name composed by `psycopg.sql`."""
    target = sql.Identifier(index.schema, index.name)
    return sql.SQL(load_blocks()[block]).format(index=target).as_string(None)


async def shrink(
    pool: Pool,
    queries: Queries,
    rebuild: list[Relation],
    drop: list[Relation],
    *,
    vacuum: bool,
    lock_timeout: float,
    rebuild_timeout: float,
) -> Shrunk:
    """Drop the leftovers `drop`; when `vacuum`, give the table's empty tail back (a truncating
    VACUUM); then rebuild the indexes `rebuild` concurrently: one after the other on one pooled
    connection, while no other session shrinks the table. The drops and the VACUUM wait at most
    `lock_timeout` seconds for a lock, each rebuild at most `rebuild_timeout` seconds in all;
    a drop or rebuild the database refuses is reported in `failed` and the rest go on. A lost
    connection propagates (ConnectionLost). The connection goes back to the pool as it came (no
    lock, its settings put back), or closed."""
    named = {"table": queries.names.outbox.identifier().as_string(None)}
    limits = {"lock_timeout": _ms(lock_timeout), "statement_timeout": _ms(rebuild_timeout)}
    notices: list[tuple[str | None, str | None]] = []
    failed: list[tuple[str, str]] = []

    async def each(
        conn: psycopg.AsyncConnection[Any], block: str, indexes: list[Relation]
    ) -> list[str]:
        done = []
        for index in indexes:
            try:
                await conn.execute(_on_index(block, index))
            except psycopg.DatabaseError as exc:
                if conn.broken:
                    raise
                failed.append((index.name, str(exc).strip()))
            else:
                done.append(index.name)
        return done

    with boundary():
        async with pooled(pool) as conn:
            try:
                begun = await (
                    await conn.execute(queries["shrink_begin"], named | limits)
                ).fetchone()
                if not (begun and begun[0]):
                    return Shrunk(True, False, [], [], [])
                dropped = await each(conn, "shrink_drop", drop)
                if vacuum:
                    notices = await _vacuum_notices(conn, queries["shrink_vacuum"])
                rebuilt: list[str] = []
                if rebuild:
                    await conn.execute(queries["shrink_rebuilding"])
                    rebuilt = await each(conn, "shrink_reindex", rebuild)
                await conn.execute(queries["shrink_end"], named)
            except BaseException:
                await conn.close()  # its lock and settings end with the session
                raise
    skipped = any(state == LOCK_NOT_AVAILABLE for state, _ in notices)
    return Shrunk(False, skipped, rebuilt, dropped, failed)


def _ms(seconds: float) -> str:
    """A duration setting's value, at least a millisecond (0 would mean none)."""
    return f"{max(int(seconds * 1000), 1)}ms"


async def dlq_queues(pool: Pool, queries: Queries) -> list[str]:
    """The queues that have DLQ rows (a loose scan of the DLQ's (queue, failed_at) index)."""
    with boundary():
        async with pooled(pool) as conn:
            rows = await (await conn.execute(queries["dlq_queues"])).fetchall()
    return [row[0] for row in rows]


async def expire_dlq(pool: Pool, queries: Queries, queue: str, age: float, batch: int) -> int:
    """Delete up to `batch` DLQ rows of `queue` that failed more than `age` seconds ago
    (database clock), skipping rows someone holds; how many were deleted."""
    params: dict[str, Any] = {"queue": queue, "age": age, "batch": batch}
    with boundary():
        async with pooled(pool) as conn:
            row = await (await conn.execute(queries["dlq_expire_queue"], params)).fetchone()
    return int(row[0]) if row else 0
