"""Table names and every identifier derived from them, validated once.

Table names are user input. They are only ever used through `psycopg.sql.Identifier`, and the
names Postgres would silently truncate (indexes, the NOTIFY channel) are refused instead: a
truncated index name breaks the schema check and a truncated channel breaks wake-ups. Every
entry point (`Farm(table=...)`, the CLI's `--table`/`--dlq-table`) builds `TableNames`, which
refuses the characters the driver cannot carry, with one message naming what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass

from psycopg import sql

from .errors import IdentifierError

MAX_IDENTIFIER_BYTES = 63  # NAMEDATALEN - 1 in a stock Postgres build
ALLOWED = "any character but '%' and NUL"
REFUSED = "%"
# Identifiers are quoted (`psycopg.sql.Identifier`), so quotes, spaces and the like are carried
# safely; but composed statements go through the driver, which reads a '%' as a placeholder
# ("positional and named placeholders cannot be mixed"), failing every claim. Doubling it would
# hold only where the text is later parsed for placeholders, so it is refused up front instead.


def _check_identifier(name: str, what: str) -> str:
    if not name:
        raise IdentifierError(f"{what} is empty")
    if "\x00" in name:
        raise IdentifierError(f"{what} {name!r} contains a NUL byte")
    if REFUSED in name:
        raise IdentifierError(
            f"{what} {name!r} contains '%', which the SQL driver reads as a placeholder: a "
            f"table name may hold {ALLOWED} (a '.' separates schema and table)"
        )
    size = len(name.encode("utf-8"))
    if size > MAX_IDENTIFIER_BYTES:
        raise IdentifierError(
            f"{what} {name!r} is {size} bytes; Postgres keeps at most {MAX_IDENTIFIER_BYTES}. "
            "Choose a shorter table name."
        )
    return name


@dataclass(frozen=True)
class QualifiedName:
    """A table name, optionally schema-qualified as `schema.table`."""

    schema: str | None
    name: str

    @classmethod
    def parse(cls, text: str, what: str) -> QualifiedName:
        if not isinstance(text, str):
            raise IdentifierError(f"{what} must be a string, not {type(text).__name__}")
        schema, dot, name = text.rpartition(".")
        if dot and not schema:
            raise IdentifierError(f"{what} {text!r} has an empty schema part")
        _check_identifier(name, what)
        if dot:
            _check_identifier(schema, f"schema of {what}")
        return cls(schema or None, name)

    def identifier(self) -> sql.Identifier:
        return sql.Identifier(self.schema, self.name) if self.schema else sql.Identifier(self.name)

    def sibling(self, suffix: str, what: str) -> sql.Identifier:
        """An index or constraint name next to this table (same schema for indexes)."""
        return sql.Identifier(_check_identifier(self.name + suffix, what))

    def schema_sibling(self, suffix: str, what: str) -> sql.Identifier:
        """A name next to this table, qualified with its schema: for objects (statistics)
        that, unlike indexes, would otherwise land in the session's current schema."""
        name = _check_identifier(self.name + suffix, what)
        return sql.Identifier(self.schema, name) if self.schema else sql.Identifier(name)

    def __str__(self) -> str:
        return f"{self.schema}.{self.name}" if self.schema else self.name


# Migration 0009's objects beside the DLQ, by placeholder: (suffix of the DLQ's name, what).
_CAUSE_OBJECTS = {
    "dlq_cause_fn": ("_cause", "DLQ cause function name"),
    "dlq_causes": ("_causes", "DLQ cause counts table name"),
    "dlq_causes_count": ("_causes_count", "DLQ cause counting function name"),
}


@dataclass(frozen=True)
class TableNames:
    """The outbox table, the optional DLQ table, and their derived identifiers."""

    outbox: QualifiedName
    dlq: QualifiedName | None

    @classmethod
    def build(cls, table: str = "outbox", dlq_table: str | None = None) -> TableNames:
        names = cls(
            QualifiedName.parse(table, "table name"),
            QualifiedName.parse(dlq_table, "DLQ table name") if dlq_table is not None else None,
        )
        if names.dlq is not None and names.dlq == names.outbox:
            raise IdentifierError("the DLQ table must differ from the outbox table")
        names.identifiers()  # refuse over-long derived names now, not at first use
        _check_identifier(names.channel, "NOTIFY channel name")
        return names

    @property
    def channel(self) -> str:
        """The NOTIFY channel: `outbox_<table>` (the table name without its schema)."""
        return f"outbox_{self.outbox.name}"

    def cause_objects(self) -> dict[str, str]:
        """The bare names of what migration 0009 makes beside the DLQ, in the DLQ's schema, by
        placeholder: the cause function, the counts table and the counting function (empty
        without a DLQ)."""
        if self.dlq is None:
            return {}
        return {key: self.dlq.name + suffix for key, (suffix, _) in _CAUSE_OBJECTS.items()}

    def identifiers(self) -> dict[str, sql.Composable]:
        """Placeholders for the SQL files and migrations (`notify_channel`: the channel as a
        string literal, for the runtime's own `pg_notify` calls)."""
        out = self.outbox
        ids: dict[str, sql.Composable] = {
            "notify_channel": sql.Literal(self.channel),
            "outbox": out.identifier(),
            "pending_idx": out.sibling("_pending_idx", "pending index name"),
            "lease_idx": out.sibling("_lease_idx", "lease index name"),
            "timer_idx": out.sibling("_timer_id_uq", "timer index name"),
            "ordering_idx": out.sibling("_order_idx", "ordering index name"),
            "blocked_idx": out.sibling("_blocked_idx", "blocked rows index name"),
            "priority_idx": out.sibling("_prio_idx", "priority index name"),
            "fair_idx": out.sibling("_fair_idx", "fair key index name"),
            "lease_ck": out.sibling("_lease_ck", "lease check name"),
            "counts_ck": out.sibling("_counts_ck", "counters check name"),
            "values_ck": out.sibling("_values_ck", "values check name"),
            "blocked_ck": out.sibling("_blocked_ck", "blocked rows check name"),
        }
        if self.dlq is not None:
            ids["dlq"] = self.dlq.identifier()
            ids["dlq_idx"] = self.dlq.sibling("_queue_failed_idx", "DLQ index name")
            ids["dlq_reason_idx"] = self.dlq.sibling("_reason_idx", "DLQ reason index name")
            ids["dlq_queue_reason_idx"] = self.dlq.sibling(
                "_queue_reason_idx", "DLQ queue and reason index name"
            )
            ids["dlq_queue_reason_stats"] = self.dlq.schema_sibling(
                "_reason_stats", "DLQ queue and reason statistics name"
            )
            ids["dlq_cause_idx"] = self.dlq.sibling("_cause_idx", "DLQ cause index name")
            for key, (suffix, what) in _CAUSE_OBJECTS.items():
                ids[key] = self.dlq.schema_sibling(suffix, what)
                # The bare name as a string literal: the counting function runs with its
                # owner's rights on a search path of pg_catalog alone, so migration 0009
                # names these objects with the schema it finds them in (format's %I).
                ids[key + "_name"] = sql.Literal(self.dlq.name + suffix)
        return ids
