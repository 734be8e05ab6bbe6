"""The schema this release expects, as data: each table's columns, indexes and CHECKs, and the
migrations that added them.

Its own module so that what the farm needs can be read (and changed with a migration) in one
place, apart from how `schema_check` compares it with the catalog and how `schema_report` tells
the operator. Expressions are compared as `normalise` flattens them, on both sides.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..names import QualifiedName

TSTZ = "timestamp with time zone"
VARCHAR = "character varying(255)"

# column -> (type, NOT NULL, must have a default)
OUTBOX_COLUMNS: dict[str, tuple[str, bool, bool]] = {
    "id": ("bigint", True, True),
    "queue": (VARCHAR, True, False),
    "payload": ("bytea", True, False),
    "headers": ("jsonb", False, False),
    "attempts_count": ("bigint", True, True),
    "deliveries_count": ("bigint", True, True),
    "created_at": (TSTZ, True, True),
    "next_attempt_at": (TSTZ, True, True),
    "first_attempt_at": (TSTZ, False, False),
    "last_attempt_at": (TSTZ, False, False),
    "acquired_at": (TSTZ, False, False),
    "acquired_token": ("uuid", False, False),
    "lease_expires_at": (TSTZ, False, False),
    "timer_id": (VARCHAR, False, False),
    "ordering_key": (VARCHAR, False, False),
    "key_blocked": ("boolean", True, True),
}

DLQ_COLUMNS: dict[str, tuple[str, bool, bool]] = {
    "id": ("bigint", True, True),
    "original_id": ("bigint", True, False),
    "queue": (VARCHAR, True, False),
    "payload": ("bytea", True, False),
    "headers": ("jsonb", False, False),
    "deliveries_count": ("bigint", True, False),
    "created_at": (TSTZ, True, False),
    "failed_at": (TSTZ, True, True),
    "failure_reason": ("character varying(64)", True, False),
    "last_exception": ("text", False, False),
    "timer_id": (VARCHAR, False, False),
}


@dataclass(frozen=True)
class ExpectedIndex:
    role: str
    columns: tuple[str, ...]
    unique: bool
    predicate: str | None  # as pg_get_expr renders it, after normalising


OUTBOX_INDEXES = (
    ExpectedIndex(
        "pending index",
        ("queue", "next_attempt_at"),
        False,
        "acquired_token IS NULL AND NOT key_blocked",
    ),
    ExpectedIndex(
        "lease index", ("queue", "lease_expires_at"), False, "acquired_token IS NOT NULL"
    ),
    ExpectedIndex("timer index", ("queue", "timer_id"), True, "timer_id IS NOT NULL"),
    ExpectedIndex(
        "ordering index", ("queue", "ordering_key", "id"), False, "ordering_key IS NOT NULL"
    ),
    ExpectedIndex(
        "blocked rows index (migration 0008)", ("queue", "ordering_key", "id"), False, "key_blocked"
    ),
)
DLQ_INDEXES = (
    ExpectedIndex("failure index", ("queue", "failed_at"), False, None),
    ExpectedIndex("reason index (migration 0007)", ("failure_reason", "id"), False, None),
    ExpectedIndex(
        "queue and reason index (migration 0007)", ("queue", "failure_reason", "id"), False, None
    ),
)
# The statement-level triggers of migration 0009 that keep the DLQ's counts by cause.
CAUSE_TRIGGERS = tuple(
    f"outbox_farm_causes_{op}" for op in ("delete", "insert", "truncate", "update")
)
CAUSES_VERSION = 9
# The operator's controls of each queue, one table for every outbox of the database (migration
# 0011; its limits' columns, 0012): column -> (type, NOT NULL, must have a default).
CONTROLS_TABLE = QualifiedName(None, "outbox_farm_queues")
CONTROL_COLUMNS: dict[str, tuple[str, bool, bool]] = {
    "target": ("text", True, False),
    "queue": (VARCHAR, True, False),
    "paused": ("boolean", True, True),
    "paused_until": (TSTZ, False, False),
    "reason": ("text", False, False),
    "changed_by": ("text", False, False),
    "changed_at": (TSTZ, True, True),
}
LIMIT_COLUMNS: dict[str, tuple[str, bool, bool]] = {
    "rate_count": ("integer", False, False),
    "rate_seconds": ("double precision", False, False),
    "max_running": ("integer", False, False),
    "tokens": ("double precision", False, False),
    "tokens_at": (TSTZ, False, False),
}
# The queue's breaker, kept by the farms in the same row (migration 0012, with the limits).
BREAKER_COLUMNS: dict[str, tuple[str, bool, bool]] = {
    "breaker_failures": ("integer", True, True),
    "breaker_open_since": (TSTZ, False, False),
    "breaker_probe_at": (TSTZ, False, False),
    "breaker_reason": ("text", False, False),
}
CONTROLS_VERSION, LIMITS_VERSION = 11, 12
# The per-key running limit (migration 0014, fair keys), in the same row as the other limits.
KEY_LIMIT_COLUMNS: dict[str, tuple[str, bool, bool]] = {
    "key_max_running": ("integer", False, False)
}
FAIR_KEYS_VERSION = 14
# A fleet's leases (migration 0015), in its home database; a farm that is not a fleet never
# reads them.
FLEET_VERSION = 15
FLEET_TABLES: dict[QualifiedName, dict[str, tuple[str, bool, bool]]] = {
    QualifiedName(None, "outbox_farm_fleet_members"): {
        "fleet": ("text", True, False),
        "member": ("text", True, False),
        "host": ("text", True, False),
        "pid": ("integer", True, False),
        "started_at": (TSTZ, True, True),
        "expires_at": (TSTZ, True, False),
    },
    QualifiedName(None, "outbox_farm_fleet_leases"): {
        "fleet": ("text", True, False),
        "database": ("text", True, False),
        "holder": ("text", True, False),
        "taken_at": (TSTZ, True, True),
        "expires_at": (TSTZ, True, False),
    },
}
# Priorities (migration 0013): a column of the outbox and an index of its due rows above 0. Not
# in OUTBOX_COLUMNS: a farm of this release claims without the column until it is there, so
# `start` must not refuse a schema without it (`missing_columns`); `check` reports it.
PRIORITY_COLUMNS: dict[str, tuple[str, bool, bool]] = {"priority": ("smallint", True, True)}
PRIORITY_INDEX = ExpectedIndex(
    "priority index (migration 0013)",
    ("queue", "priority", "next_attempt_at"),
    False,
    "acquired_token IS NULL AND NOT key_blocked AND priority > 0",
)
PRIORITY_VERSION = 13
# Fair keys (migration 0014): a column of the outbox and an index of its free rows that have
# one. Not in OUTBOX_COLUMNS either: a farm claims without it, and only a publish with a fair
# key needs it (it is refused, saying to migrate, until then).
FAIR_COLUMNS: dict[str, tuple[str, bool, bool]] = {"fair_key": ("text", False, False)}
FAIR_INDEX = ExpectedIndex(
    "fair key index (migration 0014)",
    ("queue", "fair_key", "next_attempt_at"),
    False,
    "acquired_token IS NULL AND NOT key_blocked AND fair_key IS NOT NULL",
)


def normalise(expr: str | None) -> str | None:
    """Flattened: the catalog renders an expression with parentheses and spacing of its own
    choosing, so live and expected ones are compared without them, in lower case."""
    if expr is None:
        return None
    return re.sub(r"[()\s]+", " ", expr).strip().lower()


@dataclass(frozen=True)
class ExpectedCheck:
    """A CHECK matched by what it mentions (normalised, as pg_get_constraintdef renders it):
    its constants come out in the session's time zone, so the whole text cannot be compared."""

    role: str
    mentions: tuple[str, ...]
    columns: tuple[str, ...]  # one missing or of another type is reported as such, alone

    def found_in(self, definitions: list[str]) -> bool:
        return any(
            all(part in (normalise(definition) or "") for part in self.mentions)
            for definition in definitions
        )


OUTBOX_CHECKS = (
    ExpectedCheck(
        "blocked rows CHECK (only a keyed row is key_blocked; migration 0008)",
        ("ordering_key is not null or not key_blocked",),
        ("ordering_key", "key_blocked"),
    ),
    ExpectedCheck(
        "counters CHECK (0 <= deliveries_count, attempts_count < bigint max; migration 0006)",
        (
            "deliveries_count >= 0",
            "deliveries_count < '9223372036854775807'::bigint",
            "attempts_count >= 0",
            "attempts_count < '9223372036854775807'::bigint",
        ),
        ("deliveries_count", "attempts_count"),
    ),
    ExpectedCheck(
        "values CHECK (finite timestamps within the years 1 to 9999, headers an object; "
        "migration 0006)",
        (
            "acquired_token is not null or",
            "created_at >=",
            "created_at <=",
            "next_attempt_at >=",
            "next_attempt_at <=",
            "first_attempt_at is null or",
            "last_attempt_at is null or",
            "headers is null or jsonb_typeof headers = 'object'::text",
        ),
        (
            "acquired_token",
            "created_at",
            "next_attempt_at",
            "first_attempt_at",
            "last_attempt_at",
            "headers",
        ),
    ),
)


@dataclass(frozen=True)
class OutboxAddition:
    """A column a migration added to the outbox, with its index, that no farm needs to run:
    `start` does not look for it (`missing_columns`), `check` does."""

    version: int
    feature: str
    columns: dict[str, tuple[str, bool, bool]]
    index: ExpectedIndex
    until: str  # what does not work while the column is missing


OUTBOX_ADDITIONS = (
    OutboxAddition(
        PRIORITY_VERSION,
        "priorities",
        PRIORITY_COLUMNS,
        PRIORITY_INDEX,
        "a publish with a priority is refused and every row is claimed in due order",
    ),
    OutboxAddition(
        FAIR_KEYS_VERSION,
        "fair keys",
        FAIR_COLUMNS,
        FAIR_INDEX,
        "a publish with a fair key is refused",
    ),
)
