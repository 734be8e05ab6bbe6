"""What `outbox-farm dlq list` prints: the rows, or their causes, of one database or merged from
every database of a fleet's set, as a table or as JSON.

Its own module because the reading is one call and the rest is presentation: the merge across
the set, the database column and the JSON labels are the same for rows and for causes, and the
commands that change rows (`replay`, `purge`) need none of it.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

import click

from ..admin import DlqFilter, dlq_list
from ..admin.dlq import CauseGroup, dlq_causes
from ..db.connect import Connection
from ..db.dlq import DlqRow
from ..names import TableNames
from .output import echo_json, notice, text_table
from .over_set import named, over


def list_over(
    databases: dict[str, str],
    names: TableNames,
    where: DlqFilter,
    limit: int,
    by_cause: bool,
    as_json: bool,
) -> None:
    """`list` over the set: each database's newest `limit` rows (or causes), merged and cut
    to `limit` again."""
    notice(f"reading the DLQ of {len(databases)} database(s)")
    if by_cause:
        failed = _merged(
            databases,
            lambda conn: dlq_causes(conn, names, where, limit),
            lambda group: group.rows,
            lambda groups: print_causes(groups[:limit], as_json),
            "cause(s)",
        )
    else:
        failed = _merged(
            databases,
            lambda conn: dlq_list(conn, names, where, limit),
            lambda row: row.failed_at,
            lambda rows: print_rows(rows[:limit], as_json),
            "row(s)",
        )
    if failed:
        notice(f"not read: {len(failed)} database(s){named(failed)}")
        sys.exit(1)


def _merged(
    databases: dict[str, str],
    read: Callable[[Connection], list[Any]],
    rank: Callable[[Any], Any],
    show: Callable[[list[tuple[str | None, Any]]], None],
    noun: str,
) -> dict[str, str]:
    """`read` in every database, its items labelled with their database and shown by `rank`,
    highest first; the databases not read."""
    outcome = over(databases, read, lambda _, found: f"{len(found)} {noun}", autocommit=True)
    items: list[tuple[str | None, Any]] = [
        (name, item) for name, found in outcome.lines.items() for item in found
    ]
    items.sort(key=lambda pair: rank(pair[1]), reverse=True)
    show(items)
    return outcome.failed


def _labelled(database: str | None, item: Any) -> Any:
    """A row or cause for --json: as it is, or with its database first."""
    if database is None:
        return item
    return {"database": database, **dataclasses.asdict(item)}


def print_rows(rows: Sequence[tuple[str | None, DlqRow]], as_json: bool) -> None:
    """The rows, each labelled with its database over a set (None for one database)."""
    if as_json:
        echo_json([_labelled(d, r) for d, r in rows])
        return
    if not rows:
        click.echo("no DLQ rows match")
        return
    lines = [
        [
            r.id,
            f"{r.failed_at:%Y-%m-%d %H:%M:%S}",
            r.queue,
            r.reason,
            r.deliveries_count,
            r.payload_bytes,
            r.exception[:80],
        ]
        for _, r in rows
    ]
    headers = ["id", "failed at", "queue", "reason", "deliveries", "bytes", "exception"]
    click.echo(text_table(*_with_databases(rows, headers, lines)))


def _with_databases(
    labelled: Sequence[tuple[str | None, Any]], headers: list[str], lines: list[list[Any]]
) -> tuple[list[str], list[list[Any]]]:
    """The table as it is, or, over the set, with a first column naming each line's database."""
    if all(database is None for database, _ in labelled):
        return headers, lines
    labels = [database for database, _ in labelled]
    return ["database", *headers], [[d, *line] for d, line in zip(labels, lines, strict=True)]


def print_causes(groups: Sequence[tuple[str | None, CauseGroup]], as_json: bool) -> None:
    """The causes, labelled as `print_rows`' rows are; the table ends with how to list the
    rows of the first one."""
    if as_json:
        echo_json([_labelled(d, g) for d, g in groups])
        return
    if not groups:
        click.echo("no DLQ rows match")
        return
    lines = [
        [
            g.rows,
            g.cause,
            ", ".join(g.queues),
            ", ".join(g.reasons),
            "-" if g.last_failed_at is None else f"{g.last_failed_at:%Y-%m-%d %H:%M:%S}",
        ]
        for _, g in groups
    ]
    headers = ["rows", "cause", "queues", "reasons", "last failed"]
    click.echo(text_table(*_with_databases(groups, headers, lines)))
    click.echo(f'\nthe rows of one cause: outbox-farm dlq list --cause "{groups[0][1].cause}"')
