"""What a schema check reports: each problem with the advice that fixes it, and on a schema a
newer release migrated, notes in place of the shapes that release may have changed.

Its own module because the verdict (which difference is a problem, which only a note, and what
to run) is the operator's side of the check, apart from how the live tables are compared.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .migrate import load_migrations

FIX_HINT = (
    "run `outbox-farm migrate`, or for a drifted index or CHECK drop it and recreate it as "
    "`outbox-farm sql` prints it"
)
# A dropped index of a recorded migration: a plain `migrate` skips the migration, `--repair`
# runs it again.
REPAIR_HINT = "run `outbox-farm migrate --repair` (it makes it again)"


@dataclass(frozen=True)
class Problem:
    table: str
    message: str
    # An index or CHECK of another shape, which a newer release's migration may have made.
    shape: bool = field(default=False, compare=False)

    def __str__(self) -> str:
        return f"{self.table}: {self.message}"


def _unadvised(message: str) -> str:
    """A shape problem's message without its advice to recreate, for a note."""
    for hint in (FIX_HINT, REPAIR_HINT):
        message = message.removesuffix("; " + hint)
    return message


@dataclass(frozen=True)
class Assessment:
    problems: list[Problem]
    notes: list[str]  # a schema newer than this release, and what of it differs


def assessment(problems: list[Problem], recorded: list[tuple[str, int, str]]) -> Assessment:
    """`problems` as they stand, unless `recorded` (target, version, name of each migration,
    oldest first) holds one this release does not ship: then the schema is fine as a newer
    release left it, and its index and CHECK shapes become notes without advice to recreate."""
    shipped = max(m.version for m in load_migrations())
    newer = [record for record in recorded if record[1] > shipped]
    if not newer:
        return Assessment(problems, [])
    target, version, name = newer[-1]
    notes = [
        f"the schema is newer than this release (migration {version:04d}_{name} on {target}; "
        f"this release ships up to {shipped:04d}): fine, it works with this release"
    ]
    notes += [
        f"{p.table}: {_unadvised(p.message)}, as a newer migration may have "
        "left it: leave it, and check with the release that migrated"
        for p in problems
        if p.shape
    ]
    return Assessment([p for p in problems if not p.shape], notes)
