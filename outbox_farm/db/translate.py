"""The one place where the driver's errors become outbox_farm errors, for the schema tools, the
operator tools and the producer.

Every public function of these storage modules catches `psycopg.Error` once, around the SQL it
runs, and raises what `translate` returns: callers above the storage layer catch one family
(`DatabaseError` and its subclasses, which are still `psycopg.Error`s) and never need the
driver's classes. Where the cause is one an operator fixes, the message says how: a missing
table of the farm names the table and `outbox-farm migrate`; a missing column or privilege
points at `outbox-farm check`, which reports the drift or prints the GRANT to run.
"""

from __future__ import annotations

import psycopg

from ..errors import DatabaseError, SchemaError
from ..names import QualifiedName, TableNames


class PrivilegeError(DatabaseError):
    """The database role lacks a privilege on the farm's tables; `outbox-farm check` prints
    the GRANT to run."""


class ConnectError(DatabaseError):
    """The database could not be reached; check the DSN and that the server is running."""


def _missing_table(exc: psycopg.Error, names: TableNames) -> tuple[str, QualifiedName] | None:
    """Which of the farm's tables an UndefinedTable error is about (its kind and name)."""
    if not isinstance(exc, psycopg.errors.UndefinedTable):
        return None
    primary = exc.diag.message_primary or ""
    for kind, table in (("outbox", names.outbox), ("DLQ", names.dlq)):
        if table is not None and f'"{table}"' in primary:
            return kind, table
    return None


def translate(
    exc: psycopg.Error,
    doing: str | None,
    names: TableNames | None = None,
    kind: type[DatabaseError] = DatabaseError,
) -> DatabaseError:
    """The outbox_farm error for `exc`, raised by a statement that was `doing` something (the
    message's prefix; None: the driver's text alone, for reports that already say what ran).

    `names`: the farm's tables the statement touched. Only then is a missing table a
    `SchemaError` naming it, a missing column a `SchemaError` too, and a refused privilege a
    `PrivilegeError`; anything else is a `kind` (a `MigrationError` for migrations).
    """
    text = str(exc).strip()
    if names is not None:
        missing = _missing_table(exc, names)
        if missing is not None:
            what, table = missing
            return SchemaError(
                f"{what} table {table} does not exist: run `outbox-farm migrate` (or apply "
                f"`outbox-farm sql`) first ({text})"
            )
        prefix = f"{doing}: " if doing else ""
        if isinstance(exc, psycopg.errors.InsufficientPrivilege):
            return PrivilegeError(
                f"{prefix}{text}; `outbox-farm check` prints the GRANT an owner runs to fix it"
            )
        if isinstance(exc, psycopg.errors.UndefinedColumn):
            return SchemaError(f"{prefix}{text}; `outbox-farm check` reports the drift")
    return kind(f"{doing}: {text}" if doing else text)
