"""How the commands print: JSON for scripts (`--json`), aligned tables for people, and notes
on stderr so that stdout stays the command's answer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click
import orjson


def echo_json(data: Any, compact: bool = False) -> None:
    """orjson: datetimes as RFC 3339, dataclasses as objects."""
    option = orjson.OPT_NON_STR_KEYS | (0 if compact else orjson.OPT_INDENT_2)
    click.echo(orjson.dumps(data, option=option).decode())


def text_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned first column, right-aligned numbers, two spaces between columns."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [row[0].ljust(widths[0])]
        parts += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def notice(line: str) -> None:
    """A line for the user that is not the command's output (e.g. the embedded server)."""
    click.echo(line, err=True)
