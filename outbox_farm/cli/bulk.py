"""How `dlq replay` and `dlq purge` run: count what the selection matches and bound the run
to it, report it (a dry run stops there), ask before touching more than one row, then work
batch by batch under a progress bar, each batch committed on its own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import click

from ..admin import DlqFilter, Done, Summary, dlq_summary
from ..db.connect import Connection
from ..names import TableNames
from ..ops.server import connected
from .output import echo_json, notice, text_table

Progress = Callable[[int], None]


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


@dataclass(frozen=True)
class Bulk:
    """Replay or purge: its words, and the work itself."""

    ask: str  # the confirmation's verb
    doing: str
    past: str
    target: str  # where the rows went, for the last line
    plan: Callable[[int], str]  # what would be done to so many rows
    work: Callable[[Connection, int, Progress], Done]  # conn, upto, progress

    def run(
        self,
        dsn: str | None,
        names: TableNames,
        where: DlqFilter,
        *,
        dry_run: bool,
        yes: bool,
        as_json: bool,
    ) -> None:
        """Count, report (a dry run ends there), ask, then work batch by batch."""
        with connected(dsn, notice, autocommit=True) as conn:
            summary = dlq_summary(conn, names, where)
            if _report(summary, self.plan(summary.rows), dry_run, as_json, self.past):
                return
            if summary.rows > 1 and not yes:
                click.confirm(f"{self.ask} {summary.rows} rows?", abort=True, err=True)
            done = self.batches(summary, lambda step: self.work(conn, summary.upto, step))
        if as_json:
            echo_json(
                {
                    "dry_run": False,
                    self.past: done.rows,
                    "batches": done.batches,
                    "notified": done.notified,
                }
            )
        else:
            click.echo(f"{self.past} {done.rows} row(s) {self.target} in {done.batches} batch(es)")

    def batches(self, summary: Summary, work: Callable[[Progress], Done]) -> Done:
        """`work` under a progress bar; Ctrl-C says how far it got and how to finish."""
        done = 0
        with click.progressbar(length=summary.rows, label=self.doing, file=sys.stderr) as bar:

            def step(rows: int) -> None:
                nonlocal done
                done += rows
                bar.update(rows)

            try:
                return work(step)
            except KeyboardInterrupt:
                raise click.ClickException(
                    f"interrupted: {done} row(s) done, in whole batches; the batch under way "
                    "was rolled back. Run the same command again to finish."
                ) from None


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
