"""The `outbox-farm` command line."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click
import psycopg

from .dsn import check_dsn, redact
from .errors import OutboxFarmError
from .names import TableNames

EPILOG = "Every option can also be set from the environment variable shown in its help."


def _table_options(func: Callable[..., Any]) -> Callable[..., Any]:
    func = click.option(
        "--no-dlq",
        is_flag=True,
        envvar="OUTBOX_FARM_NO_DLQ",
        help="Leave out the dead-letter table. [env OUTBOX_FARM_NO_DLQ]",
    )(func)
    func = click.option(
        "--dlq-table",
        default="outbox_dlq",
        show_default=True,
        envvar="OUTBOX_FARM_DLQ_TABLE",
        help="Dead-letter table name, optionally schema.table. [env OUTBOX_FARM_DLQ_TABLE]",
    )(func)
    func = click.option(
        "--table",
        default="outbox",
        show_default=True,
        envvar="OUTBOX_FARM_TABLE",
        help="Outbox table name, optionally schema.table. [env OUTBOX_FARM_TABLE]",
    )(func)
    return func


def _dsn_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--dsn",
        envvar="OUTBOX_FARM_DSN",
        default=None,
        help="libpq connection string or postgresql:// URL. Without one, an embedded Postgres "
        "is started under ./.outbox-farm/pgdata (OUTBOX_FARM_DATA_DIR). [env OUTBOX_FARM_DSN]",
    )(func)


def _names(table: str, dlq_table: str, no_dlq: bool) -> TableNames:
    try:
        return TableNames.build(table, None if no_dlq else dlq_table)
    except OutboxFarmError as exc:
        raise click.UsageError(str(exc)) from None


@contextmanager
def _database(dsn: str | None) -> Iterator[str]:
    """The DSN to use, starting the embedded server (and saying so) when none was given."""
    if dsn:
        try:
            yield check_dsn(dsn)
        except OutboxFarmError as exc:
            raise click.ClickException(str(exc)) from None
        return
    from .embedded import start_embedded

    try:
        url, server = start_embedded()
    except OutboxFarmError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"no --dsn given: using the embedded Postgres at {url}", err=True)
    try:
        yield url
    finally:
        server.cleanup()


def _connect(dsn: str) -> psycopg.Connection[Any]:
    try:
        return psycopg.connect(dsn, connect_timeout=10)
    except psycopg.Error as exc:
        raise click.ClickException(
            f"cannot connect to {redact(dsn)}: {str(exc).strip()}\n"
            "Check --dsn / OUTBOX_FARM_DSN and that the server is running."
        ) from None


@click.group(epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="outbox-farm")
def main() -> None:
    """outbox_farm: deliver every committed outbox row to its handler, at least once."""


@main.command(epilog=EPILOG)
@_dsn_option
@_table_options
def migrate(dsn: str | None, table: str, dlq_table: str, no_dlq: bool) -> None:
    """Create or upgrade the outbox (and DLQ) tables.

    Applies the versioned migrations that are not yet applied, in order, each in its own
    transaction, under an advisory lock; running it twice, or twice at once, is safe.
    """
    from .migrate import migrate as run_migrate

    names = _names(table, dlq_table, no_dlq)
    with _database(dsn) as url, _connect(url) as conn:
        try:
            result = run_migrate(conn, names, progress=lambda line: click.echo(f"  {line}"))
        except OutboxFarmError as exc:
            raise click.ClickException(str(exc)) from None
    click.echo(
        f"migrate: {len(result.applied)} applied, {len(result.already)} already up to date "
        f"({', '.join(str(t) for t in (names.outbox, names.dlq) if t)})"
    )


@main.command(epilog=EPILOG)
@_dsn_option
@_table_options
def check(dsn: str | None, table: str, dlq_table: str, no_dlq: bool) -> None:
    """Compare the live schema with what the farm needs; exit status 1 on drift.

    Reports every problem at once: missing tables, columns, indexes, wrong types or
    nullability, partial-index predicates, uniqueness and the lease CHECK.
    """
    from .schema_check import check_schema

    names = _names(table, dlq_table, no_dlq)
    with _database(dsn) as url, _connect(url) as conn:
        try:
            problems = check_schema(conn, str(names.outbox), str(names.dlq) if names.dlq else None)
        except OutboxFarmError as exc:
            raise click.ClickException(str(exc)) from None
    tables = ", ".join(str(t) for t in (names.outbox, names.dlq) if t)
    if not problems:
        click.echo(f"check: schema OK ({tables})")
        return
    click.echo(f"check: {len(problems)} problem(s) found ({tables}):")
    for problem in problems:
        click.echo(f"  - {problem}")
    sys.exit(1)


@main.command(name="sql", epilog=EPILOG)
@_table_options
def sql_(table: str, dlq_table: str, no_dlq: bool) -> None:
    """Print the schema DDL, for projects whose migrations live in Alembic or Django."""
    from .migrate import ddl

    click.echo(ddl(_names(table, dlq_table, no_dlq)))
