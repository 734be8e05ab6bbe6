"""The operator's statements on `outbox_farm_queues` (migrations 0011 and 0012): read the
controls of an outbox's queues, pause, resume, limit, close a breaker.

Each change is one transaction: the row's upsert and the NOTIFY (`control.notify_changed`) that
makes every farm reload its controls once the change commits, and not at all when it rolls
back. The caller's connection must not be inside a transaction. A database without the table
(or, for a limit, without its 0012 columns) is a `SchemaError` saying to run `outbox-farm
migrate`; every other refusal is a `DatabaseError`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

import psycopg

from ..errors import SchemaError
from ..names import TableNames
from .boundary import UNDEFINED_COLUMN, UNDEFINED_TABLE, translate
from .connect import Connection
from .control import notify_changed
from .operator import AdminSql

STATEMENT_FAILED = "queue control statement failed"
TABLE = "outbox_farm_queues"
FAIR_KEYS = "fair keys"
NOT_MIGRATED = (
    "this database keeps no queue controls yet ({what} of migration {version}): run "
    "`outbox-farm migrate`, then try again"
)


@dataclass(frozen=True, slots=True)
class ControlRow:
    """A row of `outbox_farm_queues` as `admin_queue_state` reads it: `paused` now, and
    `paused_until` only while that pause runs."""

    queue: str
    paused: bool
    paused_until: datetime | None
    reason: str | None
    changed_by: str | None
    changed_at: datetime | None
    rate_count: int | None
    rate_seconds: float | None
    max_running: int | None
    breaker_failures: int
    breaker_open_since: datetime | None
    breaker_reason: str | None
    breaker_probe_at: datetime | None
    key_max_running: int | None


@dataclass(frozen=True, slots=True)
class BreakerClose:
    """What `close_breaker` did: the row after (None: the breaker was not open, and nothing was
    changed), and the breaker as it was while open."""

    row: ControlRow | None
    was_open_since: datetime | None = None
    was_reason: str | None = None


@dataclass(frozen=True, slots=True)
class LimitChange:
    """What `limit` writes: each limit only when its `set_` flag is true (None clears it)."""

    set_rate: bool
    rate_count: int | None
    rate_seconds: float | None
    set_max: bool
    max_running: int | None
    set_key_max: bool = False
    key_max_running: int | None = None


def _target(names: TableNames) -> str:
    """The outbox the rows are about, as every farm of it reads them (`target`)."""
    return str(names.outbox)


def _error(exc: psycopg.Error, names: TableNames, columns: str | None) -> Exception:
    """`columns`: what of migration 0012 the statement needs (`limits`, `breaker`), named when
    the database lacks it; `fair keys`: the columns of migration 0014."""
    if exc.sqlstate == UNDEFINED_TABLE and TABLE in (exc.diag.message_primary or ""):
        return SchemaError(NOT_MIGRATED.format(what=f"the table {TABLE}", version="0011"))
    if exc.sqlstate == UNDEFINED_COLUMN and columns == FAIR_KEYS:
        what = f"the fair keys' columns of {names.outbox} and {TABLE}"
        return SchemaError(NOT_MIGRATED.format(what=what, version="0014"))
    if exc.sqlstate == UNDEFINED_COLUMN and columns is not None:
        return SchemaError(
            NOT_MIGRATED.format(what=f"the {columns}' columns of {TABLE}", version="0012")
        )
    return translate(exc, doing=STATEMENT_FAILED, names=names)


ROW_FIELDS = len(fields(ControlRow))  # the state's columns; a statement may return more


def _row(found: Any) -> ControlRow:
    return ControlRow(*found[:ROW_FIELDS])


def controls_kept(conn: Connection, names: TableNames) -> bool:
    """Whether the database has the controls table: a read that needs not fail without it."""
    try:
        row = conn.execute(AdminSql(names).render("admin_queue_controls_kept")).fetchone()
    except psycopg.Error as exc:
        raise _error(exc, names, None) from exc
    return bool(row and row[0])


def read(conn: Connection, names: TableNames, queue: str | None = None) -> list[ControlRow]:
    """The rows of `names`' outbox (of `queue` only, when given), by queue."""
    params = {"target": _target(names), "queue": queue}
    try:
        rows = conn.execute(AdminSql(names).render("admin_queue_states"), params).fetchall()
    except psycopg.Error as exc:
        raise _error(exc, names, None) from exc
    return [_row(found) for found in rows]


def _change(
    conn: Connection,
    names: TableNames,
    block: str,
    queue: str,
    params: dict[str, Any],
    *,
    columns: str | None = None,
) -> tuple[Any, ...] | None:
    """Run `block` and the NOTIFY in one transaction; the row it returned (None: none matched,
    and the transaction still commits, which changes nothing). `columns`: as in `_error`."""
    params = {"target": _target(names), "queue": queue, **params}
    try:
        with conn.transaction():
            found = conn.execute(AdminSql(names).render(block), params).fetchone()
            if found is not None:
                notify_changed(conn, names, queue)
    except psycopg.Error as exc:
        raise _error(exc, names, columns) from exc
    return None if found is None else tuple(found)


def _changed_row(found: tuple[Any, ...] | None) -> ControlRow | None:
    return None if found is None else _row(found)


def pause(
    conn: Connection,
    names: TableNames,
    queue: str,
    *,
    until: datetime | None,
    seconds: float | None,
    reason: str | None,
    by: str | None,
) -> ControlRow | None:
    """Pause `queue` until `until`, for `seconds` from now (database clock), or until resumed
    (both None). None: the end given has passed already, and nothing was changed."""
    params = {"until": until, "seconds": seconds, "reason": reason, "by": by}
    return _changed_row(_change(conn, names, "admin_queue_pause", queue, params))


def resume(conn: Connection, names: TableNames, queue: str, *, by: str | None) -> ControlRow | None:
    """End `queue`'s pause; None when the queue has no row (nothing to end)."""
    return _changed_row(_change(conn, names, "admin_queue_resume", queue, {"by": by}))


def limit(
    conn: Connection, names: TableNames, queue: str, change: LimitChange, *, by: str | None
) -> ControlRow:
    """Write `change` to `queue`'s limits; its row is made when it has none."""
    params = {
        "set_rate": change.set_rate,
        "rate_count": change.rate_count,
        "rate_seconds": change.rate_seconds,
        "set_max": change.set_max,
        "max_running": change.max_running,
        "by": by,
    }
    if not change.set_key_max:
        found = _change(conn, names, "admin_queue_limit", queue, params, columns="limits")
    else:
        found = _limit_keys(conn, names, queue, params, change.key_max_running)
    row = _changed_row(found)
    assert row is not None  # an upsert always returns its row
    return row


def _limit_keys(
    conn: Connection,
    names: TableNames,
    queue: str,
    params: dict[str, Any],
    key_max_running: int | None,
) -> tuple[Any, ...] | None:
    """`admin_queue_limit` and the per-key limit (`admin_queue_key_limit`, migration 0014) in
    one transaction, with one NOTIFY; limits of an outbox without 0014 are refused whole."""
    admin = AdminSql(names)
    params = {"target": _target(names), "queue": queue, **params}
    columns = "limits"
    try:
        with conn.transaction():
            conn.execute(admin.render("admin_queue_limit"), params)
            columns = FAIR_KEYS
            keys = {**params, "key_max_running": key_max_running}
            found = conn.execute(admin.render("admin_queue_key_limit"), keys).fetchone()
            notify_changed(conn, names, queue)
    except psycopg.Error as exc:
        raise _error(exc, names, columns) from exc
    return None if found is None else tuple(found)


def close_breaker(
    conn: Connection, names: TableNames, queue: str, *, by: str | None
) -> BreakerClose:
    """Close `queue`'s breaker if it is open, with the NOTIFY every farm reloads on; a breaker
    not open is left as it is (`BreakerClose.row` None) and nobody is notified."""
    found = _change(conn, names, "admin_queue_close_breaker", queue, {"by": by}, columns="breaker")
    if found is None:
        return BreakerClose(None)
    return BreakerClose(_row(found), found[ROW_FIELDS], found[ROW_FIELDS + 1])
