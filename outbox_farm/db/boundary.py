"""The one place where driver errors become outbox_farm errors.

Every function of `outbox_farm.db` runs its database work inside `with boundary():` (the
runtime's hot paths) or catches the driver's error once and raises `translate(...)` of it (the
schema tools, operator tools and producer, whose messages say what the statement was for). The
classes say what the caller can do about an error:

- `ConnectionLost`: no connection could be had, or it broke (a restart, a network cut, a
  terminated backend, a pool timeout). Reconnecting and retrying may succeed.
- `PrivilegeError`, `SchemaError` (both `PermanentError`): a missing privilege, table or
  column. Retrying fails the same way until an operator grants or migrates.
- `DatabaseError`: the server refused this one statement (a constraint, a cancelled query);
  the connection is fine and other statements may succeed.

The message is the driver's, stripped, so logs read as they always did; `sqlstate` is kept.
"""

from __future__ import annotations

from types import TracebackType

import psycopg

from ..errors import (
    ConnectionLost,
    DatabaseError,
    OutboxFarmError,
    PrivilegeError,
    SchemaError,
)
from ..names import QualifiedName, TableNames

DRIVER_ERRORS = (psycopg.Error, OSError)
INSUFFICIENT_PRIVILEGE = "42501"
UNDEFINED_TABLE = "42P01"
UNDEFINED_COLUMN = "42703"
# Class 08 (connection exception), the shutdowns of class 57 and a full server end the session
# or refuse one; the rest of class 57 (a cancelled statement) leaves the connection usable.
_SESSION_ENDED = ("08", "57P01", "57P02", "57P03", "57P04", "57P05", "53300")


def _connection_lost(exc: BaseException, sqlstate: str | None) -> bool:
    if isinstance(exc, OSError | psycopg.InterfaceError):
        return True
    if not isinstance(exc, psycopg.OperationalError):
        return False
    # No SQLSTATE: raised by the client (a broken socket, a pool that had no connection).
    return sqlstate is None or sqlstate.startswith(_SESSION_ENDED)


def _missing_table(exc: psycopg.Error, names: TableNames) -> tuple[str, QualifiedName] | None:
    """Which of the farm's tables an undefined-table error is about (its kind and name)."""
    primary = exc.diag.message_primary or ""
    for kind, table in (("outbox", names.outbox), ("DLQ", names.dlq)):
        if table is not None and f'"{table}"' in primary:
            return kind, table
    return None


def translate(
    exc: BaseException,
    *,
    lost: bool = False,
    doing: str | None = None,
    names: TableNames | None = None,
    kind: type[DatabaseError] = DatabaseError,
) -> DatabaseError:
    """The outbox_farm error for `exc` (returned as it is if it already is one).

    `lost`: the caller saw its connection break, whatever the error says. `doing`: what the
    statement was for, the message's prefix (None: the driver's text alone, as the runtime's
    logs have always read). `names`: the farm's tables the statement touched; only then does a
    missing table, column or privilege get a message saying which command fixes it. `kind`:
    the class of an error none of those describes (`MigrationError` for migrations).
    """
    if isinstance(exc, DatabaseError):
        return exc
    sqlstate = exc.sqlstate if isinstance(exc, psycopg.Error) else None
    text = str(exc).strip() or type(exc).__name__
    message = f"{doing}: {text}" if doing else text
    error: DatabaseError
    if lost or _connection_lost(exc, sqlstate):
        error = ConnectionLost(message)
    elif sqlstate == INSUFFICIENT_PRIVILEGE:
        hint = "; `outbox-farm check` prints the GRANT an owner runs to fix it" if names else ""
        error = PrivilegeError(message + hint)
    elif sqlstate == UNDEFINED_TABLE and names is not None and isinstance(exc, psycopg.Error):
        missing = _missing_table(exc, names)
        error = SchemaError(
            message
            if missing is None
            else f"{missing[0]} table {missing[1]} does not exist: run `outbox-farm migrate` "
            f"(or apply `outbox-farm sql`) first ({text})"
        )
    elif sqlstate == UNDEFINED_COLUMN and names is not None:
        error = SchemaError(f"{message}; `outbox-farm check` reports the drift")
    elif kind is not DatabaseError:
        error = kind(message)
    elif sqlstate in (UNDEFINED_TABLE, UNDEFINED_COLUMN):
        error = SchemaError(message)
    else:
        error = DatabaseError(message)
    error.sqlstate = sqlstate
    return error


class _Boundary:
    """Re-raises a driver error leaving the block as its outbox_farm error (cause: the
    driver's). A class, not a generator context manager: it wraps the hot claim and flush."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None or isinstance(exc, OutboxFarmError) or not isinstance(exc, DRIVER_ERRORS):
            return
        raise translate(exc) from exc


_BOUNDARY = _Boundary()


def boundary() -> _Boundary:
    return _BOUNDARY
