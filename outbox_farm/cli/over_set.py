"""One command over several databases of a fleet's set: each database's line said as it is
done, a database that fails reported by name while the others still run, and what the summary
needs (the lines, the failures). `outbox-farm fleet ...` and `dlq ... --database all` use it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..db.connect import Connection, connect
from ..errors import OutboxFarmError
from ..problems import one_line
from .output import notice


@dataclass
class Outcome:
    """What one command did over the set: per database, its line; the ones that failed."""

    lines: dict[str, Any] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


def over(
    databases: dict[str, str],
    work: Callable[[Connection], Any],
    say: Callable[[str, Any], str],
    autocommit: bool = False,
) -> Outcome:
    """`work` on each database, its line said as it is done; a failure is that database's."""
    outcome = Outcome()
    for name, dsn in databases.items():
        try:
            with connect(dsn, autocommit=autocommit, name=f"database {name}") as conn:
                outcome.lines[name] = work(conn)
        except OutboxFarmError as exc:
            outcome.failed[name] = one_line(exc)
            notice(f"  {name}: FAILED: {outcome.failed[name]}")
            continue
        notice(f"  {name}: {say(name, outcome.lines[name])}")
    return outcome


def named(names: Iterable[str]) -> str:
    """` (a, b)` for a summary's list of databases; nothing when there are none."""
    listed = sorted(names)
    return f" ({', '.join(listed)})" if listed else ""
