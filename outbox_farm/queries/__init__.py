"""All SQL of outbox_farm, as named blocks in the `.sql` files beside this module.

A block starts with `-- name: <name>` followed by comment lines that say why the statement
is shaped so. Those whole-line comments stay in the files and are dropped from the text sent to
the server, with each line's indentation: psycopg caches the parsing of a statement only up to
4 KiB of text, and the claim's explanation alone is longer than its SQL. (No string literal in
these files spans lines, so no literal loses its spaces.) Table names are `{placeholders}`
filled with `psycopg.sql.Identifier` once per `Queries` object; parameters are `%(name)s`.
Placeholders that are not table names (a NOTIFY channel, a role, a privilege list, a scratch
table) are filled the same way, with `psycopg.sql`, by the `db` module that runs the block: no
SQL text is ever pasted together from strings.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources
from string import Formatter

from psycopg import sql

from ..names import TableNames

_BLOCK = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
_COMMENT_LINE = re.compile(r"^[ \t]*--.*\n?", re.MULTILINE)
_INDENT = re.compile(r"^[ \t]+", re.MULTILINE)


@cache
def load_blocks() -> dict[str, str]:
    """Every named block of every `.sql` file in this package, by name."""
    blocks: dict[str, str] = {}
    for entry in sorted(resources.files(__package__).iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        parts = _BLOCK.split(entry.read_text(encoding="utf-8"))
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in blocks:
                raise RuntimeError(f"SQL block {name!r} is defined twice")
            blocks[name] = _INDENT.sub("", _COMMENT_LINE.sub("", body)).strip()
    return blocks


# How many older rows of its ordering key a row may have before it is marked `key_blocked`
# (migration 0008): the longest walk a claim makes behind a running head, and the most index
# entries a publish reads to decide the mark. Keys with fewer rows waiting are never marked.
KEY_WINDOW = 8


def compose(text: str, names: TableNames) -> str:
    """`text` with its `{placeholders}` filled: with the quoted identifiers of `names`,
    `{key_window}` with `KEY_WINDOW`, and a placeholder that names a block with that block
    (itself composed), so a fragment several statements share is written once.

    KeyError when the text needs `{dlq}` (or its index) and no DLQ table is configured.
    """
    return _composed(text, names).as_string(None)


def _composed(text: str, names: TableNames) -> sql.Composed:
    blocks = load_blocks()
    fields = {field for _, field, _, _ in Formatter().parse(text) if field}
    fragments = {field: _composed(blocks[field], names) for field in fields if field in blocks}
    return sql.SQL(text).format(
        **names.identifiers(), key_window=sql.Literal(KEY_WINDOW), **fragments
    )


class Queries:
    """The statements for one outbox (and optional DLQ) table, composed once.

    Each is rendered to plain text here, once: psycopg then recognises the same statement on
    every call (its parse cache and automatic prepared statements key on the text), where a
    `Composed` would be rendered again on every execute.
    """

    def __init__(self, names: TableNames) -> None:
        self.names = names
        self._composed: dict[str, str] = {}
        self._unfilled: dict[str, str] = {}  # block -> a placeholder `names` cannot fill
        for name, text in load_blocks().items():
            try:
                self._composed[name] = compose(text, names)
            except KeyError as exc:
                self._unfilled[name] = str(exc.args[0])

    def __getitem__(self, name: str) -> str:
        try:
            return self._composed[name]
        except KeyError:
            placeholder = self._unfilled.get(name)
            if placeholder is None:
                raise
            if placeholder.startswith("dlq"):
                raise KeyError(f"SQL block {name!r} needs a DLQ table") from None
            raise KeyError(
                f"SQL block {name!r} has {{{placeholder}}}, which is not a table name: "
                "the module that runs it composes it"
            ) from None
