"""`outbox-farm dlq list|show|replay|purge`: the dead-letter table from the command line.

Replay and purge first count what the selection matches (by queue and reason) and bound the
run to it; they ask before touching more than one row unless --yes, and --dry-run prints that
count and what would be done, and changes nothing. Both commit batch by batch: Ctrl-C (or a
kill) leaves whole batches done and the rest untouched, and the same command run again
finishes the job.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import click

from .admin import DlqFilter, Done, Summary, When
from .admin.dlq import DEFAULT_BATCH
from .ops_cli import duration, echo_json, json_option, session, when
from .ops_cli import table as text_table


def _filter_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(
        [
            click.option("--queue", default=None, help="Only rows of this queue."),
            click.option(
                "--reason",
                type=click.Choice(["max_deliveries", "retry_terminal", "rejected"]),
                default=None,
                help="Only rows that failed for this reason.",
            ),
            click.option(
                "--since",
                callback=when,
                default=None,
                metavar="WHEN",
                help="Only rows that failed at or after this: a duration ago (2h, 7d; on the "
                "database clock) or an ISO-8601 time.",
            ),
            click.option(
                "--until",
                callback=when,
                default=None,
                metavar="WHEN",
                help="Only rows that failed before this (same forms as --since).",
            ),
            click.option(
                "--grep",
                default=None,
                metavar="TEXT",
                help="Only rows whose exception or headers contain TEXT (any case), or whose "
                "payload contains its bytes.",
            ),
        ]
    ):
        func = option(func)
    return func


def _bulk_options(verb: str, past: str, moved: str) -> Callable[..., Any]:
    """--batch, --dry-run and --yes, worded for replay or purge."""

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(
            [
                click.option(
                    "--batch",
                    type=click.IntRange(1, 100_000),
                    default=DEFAULT_BATCH,
                    show_default=True,
                    help=f"Rows {moved} per transaction.",
                ),
                click.option(
                    "--dry-run", is_flag=True, help=f"Say what would be {past}; change nothing."
                ),
                click.option(
                    "--yes", "-y", is_flag=True, help=f"Do not ask before {verb} several rows."
                ),
            ]
        ):
            func = option(func)
        return func

    return decorate


def _where(ids: tuple[int, ...], **given: Any) -> DlqFilter:
    return DlqFilter(ids=ids or None, **given)


def _selection(ids: tuple[int, ...], every: bool, where: DlqFilter, verb: str) -> None:
    """Replay and purge never act on the whole DLQ by accident: IDs, a filter, or --all."""
    filtered = any(getattr(where, f) is not None for f in ("queue", "reason", "since", "until"))
    if ids and every:
        raise click.UsageError(f"give IDs or --all, not both: --all would {verb} every row")
    if not (ids or every or filtered or where.grep is not None):
        raise click.UsageError(
            f"say which rows to {verb}: IDs, a filter (--queue, --reason, --since, --until, "
            "--grep) or --all"
        )


def _describe(summary: Summary) -> list[str]:
    rows = [
        [
            line.queue,
            line.reason,
            line.rows,
            f"{line.first_failed_at:%Y-%m-%d %H:%M:%S}",
            f"{line.last_failed_at:%Y-%m-%d %H:%M:%S}",
        ]
        for line in summary.lines
    ]
    return text_table(["queue", "reason", "rows", "first failed", "last failed"], rows).splitlines()


def _run_batches(
    summary: Summary, verb: str, work: Callable[[Callable[[int], None]], Done]
) -> Done:
    """`work` under a progress bar; Ctrl-C says how far it got and how to finish."""
    done = 0
    with click.progressbar(length=summary.rows, label=verb, file=sys.stderr) as bar:

        def step(rows: int) -> None:
            nonlocal done
            done += rows
            bar.update(rows)

        try:
            return work(step)
        except KeyboardInterrupt:
            raise click.ClickException(
                f"interrupted: {done} row(s) done, in whole batches; the batch under way was "
                "rolled back. Run the same command again to finish."
            ) from None


def _confirm(summary: Summary, question: str, yes: bool) -> None:
    if summary.rows > 1 and not yes:
        click.confirm(f"{question} {summary.rows} rows?", abort=True, err=True)


def add_dlq(main: click.Group) -> None:
    from .cli import EPILOG, _dsn_option, _names, _table_options

    @main.group(epilog=EPILOG)
    def dlq() -> None:
        """Inspect, replay and purge the dead-letter table.

        Find rows with `list`, read one with `show`, send them back to the outbox once the
        cause is fixed with `replay`, delete what is not worth keeping with `purge`.
        """

    @dlq.command(name="list", epilog=EPILOG)
    @_dsn_option
    @_table_options
    @_filter_options
    @click.option(
        "--limit",
        type=click.IntRange(1),
        default=50,
        show_default=True,
        help="Show at most this many rows, newest first.",
    )
    @json_option
    def list_(
        dsn: str | None,
        table: str,
        dlq_table: str,
        no_dlq: bool,
        limit: int,
        as_json: bool,
        **given: Any,
    ) -> None:
        """The newest DLQ rows matching the filters: id, when and why each failed, and the
        first line of its exception."""
        from .admin import dlq_list

        names = _names(table, dlq_table, no_dlq)
        with session(dsn, names) as conn:
            rows = dlq_list(conn, names, _where((), **given), limit)
        if as_json:
            echo_json(rows)
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
            for r in rows
        ]
        headers = ["id", "failed at", "queue", "reason", "deliveries", "bytes", "exception"]
        click.echo(text_table(headers, lines))

    @dlq.command(epilog=EPILOG)
    @_dsn_option
    @_table_options
    @click.argument("row_id", metavar="ID", type=int)
    @json_option
    def show(
        dsn: str | None, table: str, dlq_table: str, no_dlq: bool, row_id: int, as_json: bool
    ) -> None:
        """One DLQ row in full: payload decoded by its content type, headers, reason, the
        exception with its traceback, counts and timestamps."""
        from .admin import dlq_show

        names = _names(table, dlq_table, no_dlq)
        with session(dsn, names) as conn:
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
    @_dsn_option
    @_table_options
    @click.argument("ids", metavar="[ID]...", nargs=-1, type=int)
    @_filter_options
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
    @json_option
    def replay(
        dsn: str | None,
        table: str,
        dlq_table: str,
        no_dlq: bool,
        ids: tuple[int, ...],
        every: bool,
        to_queue: str | None,
        delay: float,
        batch: int,
        dry_run: bool,
        yes: bool,
        as_json: bool,
        **given: Any,
    ) -> None:
        """Move DLQ rows back into the outbox, to be handled again.

        Select rows by ID, by filters, or --all. Each row keeps its payload and headers, gets
        the headers `replayed_from` (its DLQ id) and `replay_count`, fresh attempt counters
        and a due time of now (or --delay); the farm is woken by NOTIFY. Each batch moves in
        one statement, so an interrupted replay loses and repeats nothing: run it again.
        """
        from .admin import dlq_replay, dlq_summary

        names = _names(table, dlq_table, no_dlq)
        where = _where(ids, **given)
        _selection(ids, every, where, "replay")
        with session(dsn, names) as conn:
            summary = dlq_summary(conn, names, where)
            due = f"due in {delay:g}s" if delay else "due now, with a NOTIFY per queue and batch"
            target = f"queue {to_queue}" if to_queue else "their own queues"
            plan = (
                f"replay {summary.rows} row(s) from {names.dlq} into {names.outbox} "
                f"({target}, {due}), in batches of {batch}"
            )
            if _report(summary, plan, dry_run, as_json, "replayed"):
                return
            _confirm(summary, "Replay", yes)
            done = _run_batches(
                summary,
                "replaying",
                lambda step: dlq_replay(
                    conn,
                    names,
                    where,
                    to_queue=to_queue,
                    delay=delay,
                    batch=batch,
                    upto=summary.upto,
                    progress=step,
                ),
            )
        _finish(done, "replayed", f"into {names.outbox}", as_json)

    @dlq.command(epilog=EPILOG)
    @_dsn_option
    @_table_options
    @click.argument("ids", metavar="[ID]...", nargs=-1, type=int)
    @_filter_options
    @click.option(
        "--older-than",
        callback=duration,
        default=None,
        metavar="DURATION",
        help="Only rows that failed longer ago than this (90d, 12h), by the database clock.",
    )
    @click.option("--all", "every", is_flag=True, help="Purge every row of the DLQ.")
    @_bulk_options("purging", "purged", "deleted")
    @json_option
    def purge(
        dsn: str | None,
        table: str,
        dlq_table: str,
        no_dlq: bool,
        ids: tuple[int, ...],
        older_than: float | None,
        every: bool,
        batch: int,
        dry_run: bool,
        yes: bool,
        as_json: bool,
        **given: Any,
    ) -> None:
        """Delete DLQ rows for good: by ID, by filters, by age (--older-than), or --all."""
        from .admin import dlq_purge, dlq_summary

        if older_than is not None:
            if given["until"] is not None:
                raise click.UsageError("--older-than and --until say the same; give one")
            given["until"] = When(ago=older_than)
        names = _names(table, dlq_table, no_dlq)
        where = _where(ids, **given)
        _selection(ids, every, where, "purge")
        with session(dsn, names) as conn:
            summary = dlq_summary(conn, names, where)
            plan = f"delete {summary.rows} row(s) from {names.dlq}, in batches of {batch}"
            if _report(summary, plan, dry_run, as_json, "purged"):
                return
            _confirm(summary, "Delete", yes)
            done = _run_batches(
                summary,
                "purging",
                lambda step: dlq_purge(
                    conn, names, where, batch=batch, upto=summary.upto, progress=step
                ),
            )
        _finish(done, "purged", f"from {names.dlq}", as_json)


def _report(summary: Summary, plan: str, dry_run: bool, as_json: bool, verb: str) -> bool:
    """Print the count and, for a dry run, what would happen; True when there is no more
    to do (nothing matched, or a dry run)."""
    if summary.rows == 0 or dry_run:
        if as_json:
            echo_json(
                {
                    "dry_run": dry_run,
                    "matched": summary.rows,
                    "plan": plan,
                    "groups": summary.lines,
                    verb: 0,
                }
            )
        elif summary.rows == 0:
            click.echo("no DLQ rows match")
        else:
            click.echo(
                "\n".join(
                    [*_describe(summary), "", f"would {plan}", "dry run: nothing was changed"]
                )
            )
        return True
    if not as_json:
        click.echo("\n".join(_describe(summary)), err=True)
    return False


def _finish(done: Done, verb: str, where: str, as_json: bool) -> None:
    if as_json:
        echo_json(
            {"dry_run": False, verb: done.rows, "batches": done.batches, "notified": done.notified}
        )
    else:
        click.echo(f"{verb} {done.rows} row(s) {where} in {done.batches} batch(es)")
