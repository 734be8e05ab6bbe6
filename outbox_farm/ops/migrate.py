"""Versioned, forward-only schema migrations, applied under an advisory lock.

Migrations are the `.sql` files of the top-level `migrations/` folder (carried inside the wheel
as `outbox_farm/_migrations`). Each starts with `-- target: outbox` or `-- target: dlq` and uses
the same `{placeholders}` as the runtime SQL, so one file serves any table name. What was
applied is recorded per target table in `outbox_farm_migrations`; re-running is a no-op.

The records are checked against the catalog: when a target table no longer exists (dropped by
hand, or restored from a dump without it), its records are forgotten and its migrations applied
again from the first, so `migrate` brings back what `check` reports missing. Every migration is
written to be re-runnable (IF NOT EXISTS, idempotent ALTERs), which is also what lets
`repair=True` run all of them again to restore a dropped index.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path

from ..db.connect import Connection
from ..db.schema import MigrationRecord, migration_lock
from ..errors import MigrationError
from ..names import TableNames
from ..queries import compose

_FILE = re.compile(r"^(\d{4})_(\w+)\.sql$")
_TARGET = re.compile(r"^-- target: (outbox|dlq)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    target: str  # "outbox" or "dlq"
    text: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]

    def statement(self, names: TableNames) -> str:
        """The migration for these tables: its placeholders filled with their identifiers."""
        return compose(self.text, names)


def migrations_dir() -> Traversable:
    """The migrations shipped in the wheel, or the source checkout's `migrations/`."""
    packaged = resources.files("outbox_farm") / "_migrations"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "migrations"


def load_migrations(folder: Traversable | None = None) -> list[Migration]:
    folder = folder or migrations_dir()
    found: list[Migration] = []
    for entry in folder.iterdir():
        match = _FILE.match(entry.name)
        if not match:
            continue
        text = entry.read_text(encoding="utf-8")
        target = _TARGET.search(text)
        if not target:
            raise MigrationError(f"migration {entry.name} has no '-- target: outbox|dlq' line")
        found.append(Migration(int(match[1]), match[2], target[1], text))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"two migrations share a version number: {versions}")
    if not found:
        raise MigrationError(f"no migrations found in {folder}")
    return found


def selected(names: TableNames, migrations: list[Migration] | None = None) -> list[Migration]:
    """The migrations that apply to these tables (DLQ ones only when a DLQ is configured)."""
    return [m for m in (migrations or load_migrations()) if m.target == "outbox" or names.dlq]


def ddl(names: TableNames) -> str:
    """The whole schema as SQL text, for users whose migrations live in Alembic or Django."""
    parts = []
    for m in selected(names):
        text = m.statement(names)
        parts.append(f"-- outbox_farm migration {m.version:04d}_{m.name}\n{text.strip()}\n")
    return "\n".join(parts)


@dataclass
class MigrateResult:
    applied: list[str]
    already: list[str]
    repaired: list[str] = field(default_factory=list)  # recorded ones run again (repair=True)


def migrate(
    conn: Connection,
    names: TableNames,
    *,
    repair: bool = False,
    progress: Callable[[str], None] = lambda _: None,
) -> MigrateResult:
    """Apply every pending migration, each in its own transaction, under an advisory lock.

    A migration counts as pending when it was never recorded, or when its target table no
    longer exists. `repair` runs the recorded ones again too (they are idempotent), which
    brings back dropped indexes and settings. The connection must not be inside a
    transaction. Two concurrent runs are safe: the second waits for the lock and then finds
    nothing left to do. A database error is a `MigrationError`; the migrations committed
    before it stay applied.
    """
    result = MigrateResult([], [])
    with migration_lock(conn) as ledger:
        for table in ledger.missing(names):
            if ledger.forget(str(table)):
                progress(
                    f"{table} does not exist although its migrations were recorded "
                    "(dropped?): applying them again"
                )
        for m in selected(names):
            target = str(names.outbox if m.target == "outbox" else names.dlq)
            label = f"{m.version:04d}_{m.name} on {target}"
            applied = ledger.checksum(target, m.version)
            if applied is not None:
                if applied != m.checksum:
                    progress(
                        f"warning: {label} was applied from a different text "
                        "(edited after it ran?); migrations are forward-only, add a "
                        "new one instead"
                    )
                if not repair:
                    result.already.append(label)
                    continue
                progress(f"repairing {label}")
            else:
                progress(f"applying {label}")
            record = MigrationRecord(target, m.version, m.name, m.checksum)
            ledger.apply(m.statement(names), record if applied is None else None)
            (result.applied if applied is None else result.repaired).append(label)
    return result
