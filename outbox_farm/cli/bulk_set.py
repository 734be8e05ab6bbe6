"""`dlq replay` and `dlq purge` over a fleet's set (`--database all`): what `Bulk.run` does for
one database, database by database. Every database is counted first, so the one question
asked names how many rows in how many databases; each database then works with its own count
as its bound (rows dead-lettered after the question wait for the next run, as with one
database). A database that cannot be counted or fails mid-way is named in the summary while
the others are still done, and the exit status is then 1.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import click

from ..admin import DlqFilter, Done, Summary, dlq_summary
from ..db.connect import Connection
from ..names import TableNames
from .bulk import Bulk
from .output import echo_json, notice
from .over_set import Outcome, named, over


def run_over(
    bulk: Bulk,
    databases: dict[str, str],
    names: TableNames,
    where: DlqFilter,
    *,
    dry_run: bool,
    yes: bool,
    as_json: bool,
) -> None:
    """Count in every database, report (a dry run ends there), ask once, then work in each."""
    notice(f"counting the matching DLQ rows in {len(databases)} database(s)")
    counted = over(
        databases,
        lambda conn: dlq_summary(conn, names, where),
        lambda _, summary: f"{summary.rows} row(s) match",
        autocommit=True,
    )
    matched: dict[str, Summary] = {n: s for n, s in counted.lines.items() if s.rows}
    total = sum(summary.rows for summary in matched.values())
    if total == 0 or dry_run:
        _report(bulk, matched, counted.failed, dry_run, as_json)
        if counted.failed:
            sys.exit(1)
        return
    if total > 1 and not yes:
        click.confirm(
            f"{bulk.ask} {total} rows in {len(matched)} database(s)?", abort=True, err=True
        )
    done = Outcome(failed=dict(counted.failed))
    for name, summary in matched.items():
        one = _one(bulk, name, databases[name], summary)
        done.lines.update(one.lines)
        done.failed.update(one.failed)
    rows = sum(did.rows for did in done.lines.values())
    if as_json:
        echo_json(
            {
                "dry_run": False,
                bulk.past: rows,
                "databases": {n: _done_json(bulk.past, did) for n, did in done.lines.items()},
                "failed": done.failed,
            }
        )
    else:
        click.echo(
            f"{bulk.past} {rows} row(s) {bulk.target} in {len(done.lines)} database(s)"
            + (f"; {len(done.failed)} failed{named(done.failed)}" if done.failed else "")
        )
    if done.failed:
        sys.exit(1)


def _one(bulk: Bulk, name: str, dsn: str, summary: Summary) -> Outcome:
    """One database's work, bounded by its own count, under a progress bar named for it."""
    notice(f"{name}: {bulk.plan(summary.rows)}")
    labelled = dataclasses.replace(bulk, doing=f"{bulk.doing} {name}")

    def work(conn: Connection) -> Done:
        return labelled.batches(summary, lambda step: bulk.work(conn, summary.upto, step))

    return over(
        {name: dsn},
        work,
        lambda _, did: f"{bulk.past} {did.rows} row(s) in {did.batches} batch(es)",
        autocommit=True,
    )


def _report(
    bulk: Bulk, matched: dict[str, Summary], failed: dict[str, str], dry_run: bool, as_json: bool
) -> None:
    """Nothing matched, or a dry run: what would be done in each database."""
    total = sum(summary.rows for summary in matched.values())
    if as_json:
        echo_json(
            {
                "dry_run": dry_run,
                "matched": total,
                "databases": {
                    n: {"matched": s.rows, "plan": bulk.plan(s.rows), "groups": s.lines}
                    for n, s in matched.items()
                },
                "failed": failed,
                bulk.past: 0,
            }
        )
        return
    lines = [f"{name}: would {bulk.plan(s.rows)}" for name, s in matched.items()]
    if total == 0:
        lines.append("no DLQ rows match")
    else:
        lines += [
            f"{total} row(s) in {len(matched)} database(s)",
            "dry run: nothing was changed",
        ]
    if failed:
        lines.append(f"not counted: {len(failed)} database(s){named(failed)}")
    click.echo("\n".join(lines))


def _done_json(past: str, done: Done) -> dict[str, Any]:
    return {past: done.rows, "batches": done.batches, "notified": done.notified}
