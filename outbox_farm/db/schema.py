"""The schema tools' statements: the migration records under their advisory lock, the live
shape of a table for the schema check, and whether the farm's tables exist.

Migrations are decided in `outbox_farm.ops.migrate` and compared in `outbox_farm.ops.schema_check`;
what runs here only reads and writes. Catalog lookups take a table's name as quoted text
(`to_regclass`), so nothing is composed into them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg

from ..errors import MigrationError, OutboxFarmError
from ..names import QualifiedName, TableNames
from ..queries import load_blocks
from .boundary import translate
from .connect import Connection

# One fixed key: every outbox_farm migrate run on a database takes turns, whatever the tables.
MIGRATE_LOCK_KEY = 0x6F7574626F78  # "outbox"


def _missing(conn: Connection, names: TableNames) -> list[QualifiedName]:
    found = []
    for table in (names.outbox, names.dlq):
        if table is None:
            continue
        quoted = table.identifier().as_string(conn)
        row = conn.execute(load_blocks()["table_oid"], {"table": quoted}).fetchone()
        if row is None or row[0] is None:
            found.append(table)
    return found


def missing_tables(conn: Connection, names: TableNames) -> list[QualifiedName]:
    """The farm's tables that do not exist (on the search path, when not schema-qualified).

    `start`'s look before it forks: workers would only retry against a missing table.
    """
    try:
        return _missing(conn, names)
    except psycopg.Error as exc:
        raise translate(exc, doing="start-up check failed") from exc


def recorded_migrations(conn: Connection, names: TableNames) -> list[tuple[str, int, str]]:
    """(target, version, name) of each migration `migrate` recorded for these tables, oldest
    first; empty when `outbox_farm_migrations` does not exist or this role cannot read it."""
    tables = [str(table) for table in (names.outbox, names.dlq) if table is not None]
    sql_ = load_blocks()
    try:
        row = conn.execute(sql_["migrations_readable"]).fetchone()
        if row is None or not row[0]:
            return []
        found = conn.execute(sql_["migrations_recorded"], {"targets": tables}).fetchall()
    except psycopg.Error as exc:
        raise translate(exc, doing="schema check failed") from exc
    return [(str(target), int(version), str(name)) for target, version, name in found]


@dataclass(frozen=True)
class MigrationRecord:
    """One applied migration as `outbox_farm_migrations` keeps it, per target table."""

    target: str
    version: int
    name: str
    checksum: str


class MigrationLedger:
    """The records of what `migrate` applied, read and written while the lock is held.

    Only handed out by `migration_lock`, whose boundary translates every error of these
    methods into a `MigrationError`.
    """

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._sql = load_blocks()

    def missing(self, names: TableNames) -> list[QualifiedName]:
        """The tables of `names` that do not exist: their records describe nothing any more."""
        return _missing(self._conn, names)

    def forget(self, target: str) -> bool:
        """Drop the records of `target`; True when there were any."""
        return self._conn.execute(self._sql["migration_forget"], {"target": target}).rowcount > 0

    def checksum(self, target: str, version: int) -> str | None:
        """The checksum recorded for a migration of `target`; None when it was never applied."""
        row = self._conn.execute(
            self._sql["migration_applied"], {"target": target, "version": version}
        ).fetchone()
        return None if row is None else str(row[0])

    def apply(self, statement: str, record: MigrationRecord | None) -> None:
        """Run one migration's text in its own transaction, recording it there when `record`
        is given (a repair runs a recorded one again without a new record)."""
        with self._conn.transaction():
            self._conn.execute(statement)
            if record is not None:
                self._conn.execute(
                    self._sql["migration_record"],
                    {
                        "target": record.target,
                        "version": record.version,
                        "name": record.name,
                        "checksum": record.checksum,
                    },
                )


@contextmanager
def migration_lock(conn: Connection) -> Iterator[MigrationLedger]:
    """The migration records, with the advisory lock held for the whole block.

    The connection must not be inside a transaction: each migration commits on its own. It is
    switched to autocommit for the block (the lock is session-level, so it spans those
    transactions) and handed back as it came. Any database error in the block is a
    `MigrationError`; what committed before it stays.
    """
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise MigrationError("migrate() needs a connection that is not inside a transaction")
    sql_ = load_blocks()
    previous_autocommit = conn.autocommit
    conn.autocommit = True
    try:
        conn.execute(sql_["migrate_lock"], {"key": MIGRATE_LOCK_KEY})
        try:
            conn.execute(sql_["migrations_table"])
            yield MigrationLedger(conn)
        finally:
            conn.execute(sql_["migrate_unlock"], {"key": MIGRATE_LOCK_KEY})
    except OutboxFarmError:
        raise
    except psycopg.Error as exc:
        raise translate(exc, doing="migration failed", kind=MigrationError) from exc
    finally:
        conn.autocommit = previous_autocommit


@dataclass(frozen=True)
class LiveColumn:
    """A column as the catalog describes it; `type` as Postgres formats it."""

    type: str
    not_null: bool
    has_default: bool


@dataclass(frozen=True)
class LiveIndex:
    """A valid index: key columns in order, and its partial predicate (None: every row)."""

    name: str
    columns: tuple[str, ...]
    unique: bool
    primary: bool
    predicate: str | None


@dataclass(frozen=True)
class LiveTable:
    """What the schema check compares: columns by name, valid indexes, CHECK definitions."""

    columns: dict[str, LiveColumn]
    indexes: list[LiveIndex]
    checks: list[str]


def read_table(conn: Connection, table: QualifiedName) -> LiveTable | None:
    """The live shape of `table`; None when it does not exist.

    Runs in the connection's current transaction, if any, so a check sees that transaction's
    own uncommitted changes.
    """
    sql_ = load_blocks()
    try:
        quoted = table.identifier().as_string(conn)
        row = conn.execute(sql_["table_oid"], {"table": quoted}).fetchone()
        oid = row[0] if row else None
        if oid is None:
            return None
        columns = {
            name: LiveColumn(type_, not_null, has_default)
            for name, type_, not_null, has_default in conn.execute(
                sql_["columns"], {"oid": oid}
            ).fetchall()
        }
        indexes = [
            LiveIndex(name, tuple(keys), unique, primary, predicate)
            for name, keys, unique, primary, predicate in conn.execute(
                sql_["indexes"], {"oid": oid}
            ).fetchall()
        ]
        checks = [
            str(definition)
            for _, definition in conn.execute(sql_["checks"], {"oid": oid}).fetchall()
        ]
    except psycopg.Error as exc:
        raise translate(exc, doing="schema check failed") from exc
    return LiveTable(columns, indexes, checks)


@dataclass(frozen=True)
class LiveCauses:
    """What of migration 0009 a DLQ has: the cause function, the counts table, the names of the
    enabled triggers that keep the counts, and the index on the cause."""

    function: bool
    counts_table: bool
    triggers: tuple[str, ...]
    index: bool


def read_causes(conn: Connection, names: TableNames) -> LiveCauses | None:
    """Migration 0009's objects beside the DLQ of `names`; None when it has no DLQ or the DLQ
    does not exist."""
    if names.dlq is None:
        return None
    sql_ = load_blocks()
    try:
        quoted = names.dlq.identifier().as_string(conn)
        row = conn.execute(sql_["table_oid"], {"table": quoted}).fetchone()
        if row is None or row[0] is None:
            return None
        objects = names.cause_objects()
        found = conn.execute(
            sql_["dlq_cause_objects"],
            {
                "oid": row[0],
                "cause_fn": objects["dlq_cause_fn"],
                "causes": objects["dlq_causes"],
                "causes_count": objects["dlq_causes_count"],
            },
        ).fetchone()
    except psycopg.Error as exc:
        raise translate(exc, doing="schema check failed") from exc
    if found is None:  # dropped since it was found
        return None
    function, counts_table, triggers, index = found
    return LiveCauses(bool(function), bool(counts_table), tuple(triggers), bool(index))
