"""`outbox-farm dlq list|show|replay|purge`: the dead-letter table from the command line.

Replay and purge first count what the selection matches (by queue and reason) and bound the
run to it; they ask before touching more than one row unless --yes, and --dry-run prints that
count and what would be done, and changes nothing. Both commit batch by batch: Ctrl-C (or a
kill) leaves whole batches done and the rest untouched, and the same command run again
finishes the job. The filters, and what replay and purge select with them, are in `dlq_filters`;
what `list` prints, from one database or the whole set, is in `dlq_listing`.
"""

from __future__ import annotations

import dataclasses
import json

import click

from ..admin import DlqFilter, Done, When, dlq_list, dlq_purge, dlq_replay, dlq_show
from ..admin.dlq import (
    DEFAULT_BATCH,
    dlq_causes,
    dlq_unfit,
)
from ..db.connect import Connection
from ..names import TableNames
from ..ops.server import connected
from .bulk import Bulk, Progress
from .bulk_set import run_over
from .dlq_filters import filter_options, selected
from .dlq_listing import list_over, print_causes, print_rows
from .options import (
    EPILOG,
    Decorator,
    duration,
    group,
    json_option,
    table_options,
    tenant_dsn_options,
    tenant_set_options,
)
from .output import echo_json, notice


def _bulk_options(doing: str, past: str, moved: str) -> Decorator:
    """--batch, --dry-run and --yes, worded for replay or purge."""
    return group(
        click.option(
            "--batch",
            type=click.IntRange(1, 100_000),
            default=DEFAULT_BATCH,
            show_default=True,
            help=f"Rows {moved} per transaction.",
        ),
        click.option("--dry-run", is_flag=True, help=f"Say what would be {past}; change nothing."),
        click.option("--yes", "-y", is_flag=True, help=f"Do not ask before {doing} several rows."),
    )


ids_argument = click.argument("ids", metavar="[ID]...", nargs=-1, type=int)


@click.group(epilog=EPILOG)
def dlq() -> None:
    """Inspect, replay and purge the dead-letter table.

    Find rows with `list`, read one with `show`, send them back to the outbox once the
    cause is fixed with `replay`, delete what is not worth keeping with `purge`.
    """


@dlq.command(name="list", epilog=EPILOG)
@tenant_set_options
@table_options
@filter_options
@click.option(
    "--limit",
    type=click.IntRange(1),
    default=50,
    show_default=True,
    help="Show at most this many rows, newest first (with --group: this many causes); with "
    "--database all, this many of the whole set.",
)
@click.option(
    "--group",
    "by_cause",
    is_flag=True,
    help="Count the rows by cause instead, most first: the exception with ids, numbers, "
    "addresses and long quoted values replaced, so rows that differ only in those count "
    "together. Give a cause back as --cause to list, replay or purge its rows.",
)
@json_option(
    "an array of rows, newest first; with --group, of causes, most rows first; with "
    '--database all, each with its "database", and the databases not read on stderr'
)
def list_(
    dsn: str | dict[str, str] | None,
    names: TableNames,
    where: DlqFilter,
    limit: int,
    by_cause: bool,
    as_json: bool,
) -> None:
    """The newest DLQ rows matching the filters: id, when and why each failed, and the
    first line of its exception. With --group, how many rows each cause has.

    With --fleet APP --database all: the rows of every database of the set (the filters
    applying in each), each with its database, newest first across the set and --limit
    rows in all; a database that cannot be read is named, the others still listed, and the
    exit status is then 1."""
    if isinstance(dsn, dict):
        list_over(dsn, names, where, limit, by_cause, as_json)
        return
    if by_cause:
        with connected(dsn, notice, autocommit=True) as conn:
            print_causes([(None, g) for g in dlq_causes(conn, names, where, limit)], as_json)
        return
    with connected(dsn, notice, autocommit=True) as conn:
        rows = dlq_list(conn, names, where, limit)
    print_rows([(None, r) for r in rows], as_json)


@dlq.command(epilog=EPILOG)
@tenant_dsn_options
@table_options
@click.argument("row_id", metavar="ID", type=int)
@json_option("one object")
def show(dsn: str | None, names: TableNames, row_id: int, as_json: bool) -> None:
    """One DLQ row in full: payload decoded by its content type, headers, reason, the
    exception with its traceback, counts and timestamps."""
    with connected(dsn, notice, autocommit=True) as conn:
        entry = dlq_show(conn, names, row_id)
    if entry is None:
        raise click.ClickException(f"no DLQ row {row_id}; `outbox-farm dlq list` shows ids")
    if as_json:
        echo_json(entry)
        return
    payload = entry.payload.value
    shown = json.dumps(payload, indent=2) if entry.payload.encoding == "json" else payload
    for label, value in [
        ("id", entry.id),
        ("original id", entry.original_id),
        ("queue", entry.queue),
        ("reason", entry.reason),
        ("deliveries", entry.deliveries_count),
        ("created at", entry.created_at),
        ("failed at", entry.failed_at),
        ("timer id", entry.timer_id or "-"),
    ]:
        click.echo(f"{label + ':':13}{value}")
    click.echo(f"headers:\n{json.dumps(entry.headers, indent=2, sort_keys=True)}")
    click.echo(f"payload ({entry.payload.encoding}, {entry.payload_bytes} bytes):\n{shown}")
    click.echo(f"exception:\n{entry.last_exception or '-'}")


@dlq.command(epilog=EPILOG)
@tenant_set_options
@table_options
@ids_argument
@filter_options
@click.option("--all", "every", is_flag=True, help="Replay every row of the DLQ.")
@click.option(
    "--to-queue",
    default=None,
    help="Send the rows to this queue instead of "
    "their own (e.g. a queue whose handler was fixed under a new name).",
)
@click.option(
    "--delay",
    callback=duration,
    default="0",
    metavar="DURATION",
    help="Make the rows due this long from now (45s, 15m), to spread a big "
    "replay or wait for a deploy.  [default: now]",
)
@_bulk_options("replaying", "replayed", "moved")
@json_option(
    "one object: the count, or what was replayed; with --database all, the total, each database's "
    'under "databases" and the ones that failed under "failed"'
)
def replay(
    dsn: str | dict[str, str] | None,
    names: TableNames,
    ids: tuple[int, ...],
    where: DlqFilter,
    every: bool,
    to_queue: str | None,
    delay: float,
    batch: int,
    dry_run: bool,
    yes: bool,
    as_json: bool,
) -> None:
    """Move DLQ rows back into the outbox, to be handled again.

    Select rows by ID, by filters, or --all. Each row keeps its payload and headers, gets
    the headers `replayed_from` (its DLQ id) and `replay_count`, fresh attempt counters
    and a due time of now (or --delay); the farm is woken by NOTIFY. Each batch moves in
    one statement, so an interrupted replay loses and repeats nothing: run it again.

    A value the outbox refuses (an `invalid_row` whose created_at is infinity or outside
    the years 1 to 9999, or whose headers are not a JSON object) is normalised rather than
    left behind: created_at becomes the time of the replay, other headers are kept under
    `original_headers`, and the header `replay_normalised` says what changed. Such rows are
    named by id on stderr as the replay starts; to drop one instead, `dlq purge` it first.

    With --fleet APP --database all: in every database of the set, with the same selection
    (ids, if given, are each database's own). Every database is counted first and one
    question asked for the whole; each then replays what it counted, a database that fails
    is named in the summary while the others go on, and the exit status is then 1.
    """
    where = selected(where, ids, every, "replay")
    due = f"due in {delay:g}s" if delay else "due now, with a NOTIFY per queue and batch"
    target = f"queue {to_queue}" if to_queue else "their own queues"

    def work(conn: Connection, upto: int, step: Progress) -> Done:
        _report_unfit(conn, names, where, upto)
        return dlq_replay(
            conn,
            names,
            where,
            to_queue=to_queue,
            delay=delay,
            batch=batch,
            upto=upto,
            progress=step,
        )

    bulk = Bulk(
        ask="Replay",
        doing="replaying",
        past="replayed",
        target=f"into {names.outbox}",
        plan=lambda rows: (
            f"replay {rows} row(s) from {names.dlq} into {names.outbox} "
            f"({target}, {due}), in batches of {batch}"
        ),
        work=work,
    )
    _run(bulk, dsn, names, where, dry_run=dry_run, yes=yes, as_json=as_json)


def _report_unfit(conn: Connection, names: TableNames, where: DlqFilter, upto: int) -> None:
    """Name, on stderr, the rows the replay normalises and what it changes in each: the
    operator sees which messages will not be handled exactly as they were dead-lettered."""
    unfit = dlq_unfit(conn, names, where, upto=upto)
    if not unfit.rows:
        return
    lines = [f"{unfit.rows} row(s) hold values the outbox refuses; replayed normalised:"]
    lines += [f"  {row.id}: {row.what}" for row in unfit.first]
    if unfit.rows > len(unfit.first):
        lines.append(f"  and {unfit.rows - len(unfit.first)} more")
    notice("\n".join(lines))


@dlq.command(epilog=EPILOG)
@tenant_set_options
@table_options
@ids_argument
@filter_options
@click.option(
    "--older-than",
    callback=duration,
    default=None,
    metavar="DURATION",
    help="Only rows that failed longer ago than this (90d, 12h), by the database clock.",
)
@click.option("--all", "every", is_flag=True, help="Purge every row of the DLQ.")
@_bulk_options("purging", "purged", "deleted")
@json_option(
    "one object: the count, or what was purged; with --database all, the total, each database's "
    'under "databases" and the ones that failed under "failed"'
)
def purge(
    dsn: str | dict[str, str] | None,
    names: TableNames,
    ids: tuple[int, ...],
    where: DlqFilter,
    older_than: float | None,
    every: bool,
    batch: int,
    dry_run: bool,
    yes: bool,
    as_json: bool,
) -> None:
    """Delete DLQ rows for good: by ID, by filters, by age (--older-than), or --all.

    With --fleet APP --database all: in every database of the set, with the same selection
    (ids, if given, are each database's own). Every database is counted first and one
    question asked for the whole; each then purges what it counted, a database that fails is
    named in the summary while the others go on, and the exit status is then 1."""
    if older_than is not None:
        if where.until is not None:
            raise click.UsageError("--older-than and --until say the same; give one")
        where = dataclasses.replace(where, until=When(ago=older_than))
    where = selected(where, ids, every, "purge")
    bulk = Bulk(
        ask="Delete",
        doing="purging",
        past="purged",
        target=f"from {names.dlq}",
        plan=lambda rows: f"delete {rows} row(s) from {names.dlq}, in batches of {batch}",
        work=lambda conn, upto, step: dlq_purge(
            conn, names, where, batch=batch, upto=upto, progress=step
        ),
    )
    _run(bulk, dsn, names, where, dry_run=dry_run, yes=yes, as_json=as_json)


def _run(
    bulk: Bulk,
    dsn: str | dict[str, str] | None,
    names: TableNames,
    where: DlqFilter,
    *,
    dry_run: bool,
    yes: bool,
    as_json: bool,
) -> None:
    """`bulk` on one database, or on every database of the set when `dsn` names them all."""
    if isinstance(dsn, dict):
        run_over(bulk, dsn, names, where, dry_run=dry_run, yes=yes, as_json=as_json)
    else:
        bulk.run(dsn, names, where, dry_run=dry_run, yes=yes, as_json=as_json)
