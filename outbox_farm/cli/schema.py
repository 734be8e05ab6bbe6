"""`migrate`, `check` and `sql`: the farm's tables, created, compared and printed."""

from __future__ import annotations

import sys

import click

from ..names import TableNames
from ..ops.migrate import ddl, migrate
from ..ops.readiness import schema_report
from ..ops.server import connected
from .options import EPILOG, json_option, table_options, tenant_dsn_options
from .output import echo_json, notice


def _listed(names: TableNames) -> list[str]:
    return [str(t) for t in (names.outbox, names.dlq) if t]


def _tables(names: TableNames) -> str:
    return ", ".join(_listed(names))


@click.command(name="migrate", epilog=EPILOG)
@tenant_dsn_options
@table_options
@click.option(
    "--repair",
    is_flag=True,
    envvar="OUTBOX_FARM_REPAIR",
    help="Run the already applied migrations again too (each is re-runnable): brings back a "
    "dropped index or table setting that `check` reports, and rebuilds the lease index, so "
    "prefer a quiet moment on a large table. [env OUTBOX_FARM_REPAIR]",
)
@json_option('one object: the "applied", "already" and "repaired" migrations, the "tables"')
def migrate_command(dsn: str | None, names: TableNames, repair: bool, as_json: bool) -> None:
    """Create or upgrade the outbox (and DLQ) tables.

    Applies the versioned migrations that are not yet applied, in order, each in its own
    transaction, under an advisory lock; running it twice, or twice at once, is safe. A table
    that was dropped after its migrations ran gets them again. With --json, the progress
    lines go to stderr and stdout is the one object.
    """
    with connected(dsn, notice) as conn:
        result = migrate(
            conn,
            names,
            repair=repair,
            progress=lambda line: click.echo(f"  {line}", err=as_json),
        )
    if as_json:
        echo_json(
            {
                "applied": result.applied,
                "already": result.already,
                "repaired": result.repaired,
                "tables": _listed(names),
            }
        )
        return
    repaired = f", {len(result.repaired)} repaired" if repair else ""
    click.echo(
        f"migrate: {len(result.applied)} applied, {len(result.already)} already up to date"
        f"{repaired} ({_tables(names)})"
    )


@click.command(epilog=EPILOG)
@tenant_dsn_options
@table_options
@json_option('one object: "ok", the "problems" and "notes", the "tables"; exit status as in text')
def check(dsn: str | None, names: TableNames, as_json: bool) -> None:
    """Compare the live schema, and this role's privileges, with what the farm needs; exit
    status 1 on drift.

    Reports every problem at once: missing tables, columns, indexes, wrong types or
    nullability, partial-index predicates, uniqueness, the lease CHECK, and each missing
    privilege with the GRANT that gives it.
    """
    with connected(dsn, notice) as conn:
        report = schema_report(conn, names)
    if as_json:
        echo_json(
            {
                "ok": not report.problems,
                "problems": report.problems,
                "notes": report.notes,
                "tables": _listed(names),
            }
        )
        if report.problems:
            sys.exit(1)
        return
    for note in report.notes:
        click.echo(f"note: {note}")
    if not report.problems:
        click.echo(f"check: schema OK ({_tables(names)})")
        return
    click.echo(f"check: {len(report.problems)} problem(s) found ({_tables(names)}):")
    for problem in report.problems:
        click.echo(f"  - {problem}")
    sys.exit(1)


@click.command(epilog=EPILOG)
@table_options
def sql(names: TableNames) -> None:
    """Print the schema DDL, for projects whose migrations live in Alembic or Django.

    The output is SQL text (no --json): paste it into a migration of your own.
    """
    click.echo(ddl(names))
