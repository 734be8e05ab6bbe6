"""The operator tools' statements, composed from the named blocks of `queries/admin.sql`.

Like `queries.Queries`, but a placeholder may also be filled with another named block (the DLQ
filter, a count's condition) or with one of the tables, so a filter is written once and shared
by list, summary, replay and purge instead of being copied into each. Nothing is composed other
than through `psycopg.sql`; every value stays a parameter.
"""

from __future__ import annotations

from psycopg import sql

from ..names import TableNames
from ..queries import load_blocks


class AdminSql:
    """Statements for one pair of tables, each rendered to text once and kept."""

    def __init__(self, names: TableNames) -> None:
        self.names = names
        self._identifiers = names.identifiers()
        self._rendered: dict[tuple[str, tuple[tuple[str, str], ...]], str] = {}

    def table(self, which: str) -> sql.Composable:
        """The identifier of `outbox` or `dlq` (KeyError when no DLQ table is configured)."""
        return self._identifiers[which]

    def render(self, block: str, **parts: str) -> str:
        """Block `block` with each `{part}` filled by the block of that name, itself filled from
        the same parts (`table=` names a table, `outbox` or `dlq`, instead of a block)."""
        key = (block, tuple(sorted(parts.items())))
        if key not in self._rendered:
            self._rendered[key] = self._compose(block, parts).as_string(None)
        return self._rendered[key]

    def _compose(self, block: str, parts: dict[str, str]) -> sql.Composed:
        text = load_blocks()[block]
        fill: dict[str, sql.Composable] = dict(self._identifiers)
        for name, value in parts.items():
            if "{" + name + "}" not in text:
                continue
            if name == "table":
                fill[name] = self.table(value)
            else:
                rest = {k: v for k, v in parts.items() if k != name}
                fill[name] = self._compose(value, rest)
        return sql.SQL(text).format(**fill)
