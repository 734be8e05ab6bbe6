"""The `outbox-farm` command line."""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
import psycopg

from .dsn import check_dsn, redact
from .errors import ConfigurationError, OutboxFarmError
from .exposition import parse_bind
from .names import TableNames
from .ops_cli import duration

EPILOG = "Every option can also be set from the environment variable shown in its help."


def _check_bind(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """--metrics-bind, checked while the command line is read: a typo is a usage error naming
    the option, not a traceback from the arbiter (and a restart loop under a supervisor)."""
    text = value.strip()
    if text:
        try:
            parse_bind(text)
        except ConfigurationError as exc:
            raise click.BadParameter(str(exc), ctx, param) from None
    return text


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


def _seconds_option(
    name: str, default: float, minimum: float, text: str
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A duration in seconds, with its default shown and its environment variable named."""
    env = "OUTBOX_FARM_" + name.upper().replace("-", "_")
    return click.option(
        f"--{name}",
        type=click.FloatRange(minimum),
        default=default,
        show_default=True,
        envvar=env,
        help=f"{text} [env {env}]",
    )


def _read_dsn_file(path: str) -> str:
    """The DSN kept in a file (a container secret): whitespace and the final newline stripped."""
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise click.BadParameter(
            f"cannot read {path}: {exc}; point it at a readable file holding the connection string",
            param_hint="'--dsn-file' / OUTBOX_FARM_DSN_FILE",
        ) from None
    if not text:
        raise click.BadParameter(
            f"{path} is empty; write the connection string into it",
            param_hint="'--dsn-file' / OUTBOX_FARM_DSN_FILE",
        )
    return text


def _dsn_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """--dsn and --dsn-file, merged into the command's one `dsn` argument (None: embedded).

    The file (or the environment) keeps the password out of every process's command line,
    where `ps` and /proc show it to any user of the machine.
    """

    @functools.wraps(func)
    def command(*args: Any, dsn: str | None, dsn_file: str | None, **kwargs: Any) -> Any:
        if dsn and dsn_file:
            raise click.UsageError(
                "--dsn (OUTBOX_FARM_DSN) and --dsn-file (OUTBOX_FARM_DSN_FILE) are both set; "
                "keep one"
            )
        return func(*args, dsn=_read_dsn_file(dsn_file) if dsn_file else dsn, **kwargs)

    command = click.option(
        "--dsn-file",
        envvar="OUTBOX_FARM_DSN_FILE",
        default=None,
        metavar="PATH",
        help="Read the connection string from this file (e.g. a container secret), so no "
        "password shows on the command line. [env OUTBOX_FARM_DSN_FILE]",
    )(command)
    return click.option(
        "--dsn",
        envvar="OUTBOX_FARM_DSN",
        default=None,
        help="libpq connection string or postgresql:// URL; prefer OUTBOX_FARM_DSN or "
        "--dsn-file, since a command line is visible to every user of the machine. Without "
        "any, an embedded Postgres is started under ./.outbox-farm/pgdata "
        "(OUTBOX_FARM_DATA_DIR). [env OUTBOX_FARM_DSN]",
    )(command)


def _names(table: str, dlq_table: str, no_dlq: bool) -> TableNames:
    try:
        return TableNames.build(table, None if no_dlq else dlq_table)
    except OutboxFarmError as exc:
        raise click.UsageError(str(exc)) from None


@contextmanager
def _database(
    dsn: str | None, say: Callable[[str], None] = lambda line: click.echo(line, err=True)
) -> Iterator[str]:
    """The DSN to use, starting the embedded server (and saying so) when none was given."""
    if dsn:
        try:
            checked = check_dsn(dsn)
        except OutboxFarmError as exc:
            raise click.ClickException(str(exc)) from None
        yield checked
        return
    from .embedded import start_embedded

    try:
        url, server = start_embedded()
    except OutboxFarmError as exc:
        raise click.ClickException(str(exc)) from None
    say(f"no --dsn given: using the embedded Postgres at {url}")
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
            "Check --dsn / OUTBOX_FARM_DSN (or the file of --dsn-file) and that the server is "
            "running."
        ) from None


@click.group(epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="outbox-farm")
def main() -> None:
    """outbox_farm: deliver every committed outbox row to its handler, at least once."""


@main.command(epilog=EPILOG)
@_dsn_option
@_table_options
@click.option(
    "--repair",
    is_flag=True,
    envvar="OUTBOX_FARM_REPAIR",
    help="Run the already applied migrations again too (each is re-runnable): brings back a "
    "dropped index or table setting that `check` reports, and rebuilds the lease index, so "
    "prefer a quiet moment on a large table. [env OUTBOX_FARM_REPAIR]",
)
def migrate(dsn: str | None, table: str, dlq_table: str, no_dlq: bool, repair: bool) -> None:
    """Create or upgrade the outbox (and DLQ) tables.

    Applies the versioned migrations that are not yet applied, in order, each in its own
    transaction, under an advisory lock; running it twice, or twice at once, is safe. A table
    that was dropped after its migrations ran gets them again.
    """
    from .migrate import migrate as run_migrate

    names = _names(table, dlq_table, no_dlq)
    with _database(dsn) as url, _connect(url) as conn:
        try:
            result = run_migrate(
                conn, names, repair=repair, progress=lambda line: click.echo(f"  {line}")
            )
        except OutboxFarmError as exc:
            raise click.ClickException(str(exc)) from None
    repaired = f", {len(result.repaired)} repaired" if repair else ""
    click.echo(
        f"migrate: {len(result.applied)} applied, {len(result.already)} already up to date"
        f"{repaired} ({', '.join(str(t) for t in (names.outbox, names.dlq) if t)})"
    )


@main.command(epilog=EPILOG)
@_dsn_option
@_table_options
def check(dsn: str | None, table: str, dlq_table: str, no_dlq: bool) -> None:
    """Compare the live schema, and this role's privileges, with what the farm needs; exit
    status 1 on drift.

    Reports every problem at once: missing tables, columns, indexes, wrong types or
    nullability, partial-index predicates, uniqueness, the lease CHECK, and each missing
    privilege with the GRANT that gives it.
    """
    from .privileges import check_privileges
    from .schema_check import check_schema

    names = _names(table, dlq_table, no_dlq)
    with _database(dsn) as url, _connect(url) as conn:
        try:
            access = check_privileges(conn, names)
            problems: list[object] = []
            if not access.schema_usage_missing:  # else the catalog lookups are refused
                dlq = str(names.dlq) if names.dlq else None
                problems += check_schema(conn, str(names.outbox), dlq)
            problems += access.problems
        except OutboxFarmError as exc:
            raise click.ClickException(str(exc)) from None
    for note in access.notes:
        click.echo(f"note: {note}")
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


METRICS_MARKER = ".outbox-farm-metrics"
# The files prometheus_client's multiprocess mode writes: <type>_<pid>.db.
_METRIC_FILE = re.compile(r"^(counter|histogram|summary|gauge_[a-z]+)_\d+\.db$")


def _prepare_metrics_dir(path: str | None) -> str:
    """Point PROMETHEUS_MULTIPROC_DIR at a directory of the farm's own, emptied of the metric
    files of earlier runs, before anything imports prometheus_client.

    The farm deletes files there, so it only takes a directory that is new, empty, or marked
    by an earlier run (METRICS_MARKER) and holding nothing but metric files: a directory a web
    app also writes its metrics to is refused, never wiped. One made here (no --metrics-dir)
    is removed again when the arbiter exits.
    """
    import atexit
    import tempfile

    if path is None:
        path = tempfile.mkdtemp(prefix="outbox-farm-metrics-")
        owner, made = os.getpid(), path

        def remove() -> None:
            if os.getpid() == owner:  # never from a forked worker
                shutil.rmtree(made, ignore_errors=True)

        atexit.register(remove)
    folder = Path(path)
    hint = "'--metrics-dir' / OUTBOX_FARM_METRICS_DIR"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        entries = sorted(entry.name for entry in folder.iterdir())
        marked = METRICS_MARKER in entries
        foreign = [
            name for name in entries if name != METRICS_MARKER and not _METRIC_FILE.match(name)
        ]
        if entries and (not marked or foreign):
            shown = ", ".join((foreign or entries)[:5])
            raise click.BadParameter(
                f"{folder} holds files outbox-farm did not write ({shown}); the farm empties "
                "its metrics directory at every start, so give it one of its own (new or "
                "empty), or leave the option out for a temporary one",
                param_hint=hint,
            )
        (folder / METRICS_MARKER).write_text("outbox-farm metrics; emptied at every start\n")
        for name in entries:
            if _METRIC_FILE.match(name):
                (folder / name).unlink()
    except OSError as exc:
        raise click.BadParameter(f"cannot use {folder}: {exc}", param_hint=hint) from None
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(folder)
    return str(folder)


def _ready(
    conn: psycopg.Connection[Any], names: TableNames, apply: bool, log: logging.Logger
) -> None:
    """start's one look at the database: migrate if asked, then refuse to begin without the
    tables or the privileges the workers need (they would only retry in a loop)."""
    from .migrate import migrate as run_migrate
    from .privileges import check_privileges
    from .queries import load_blocks

    try:
        if apply:
            result = run_migrate(conn, names)
            log.info(
                "migrate: %d applied",
                len(result.applied),
                extra={"event": "migrated", "applied": result.applied},
            )
        access = check_privileges(conn, names)
        missing = (
            []
            if access.schema_usage_missing
            else [
                str(t)
                for t in (names.outbox, names.dlq)
                if t
                and conn.execute(
                    load_blocks()["table_oid"], {"table": t.identifier().as_string(conn)}
                ).fetchone()
                == (None,)
            ]
        )
    except OutboxFarmError as exc:
        raise click.ClickException(str(exc)) from None
    except psycopg.Error as exc:
        raise click.ClickException(f"start-up check failed: {exc}") from None
    if missing:
        raise click.ClickException(
            f"table(s) {', '.join(missing)} do not exist: run `outbox-farm migrate` first"
        )
    if access.problems:
        raise click.ClickException(
            "the database role lacks privileges the farm needs:\n  - "
            + "\n  - ".join(access.problems)
        )
    for note in access.notes:
        log.warning(note, extra={"event": "privileges_note"})


@main.command(epilog=EPILOG)
@click.argument("app", envvar="OUTBOX_FARM_APP")
@_dsn_option
@click.option(
    "--procs",
    type=click.IntRange(1, 512),
    envvar="OUTBOX_FARM_PROCS",
    default=os.cpu_count() or 1,
    show_default="number of CPUs",
    help="Worker processes. About one per core. [env OUTBOX_FARM_PROCS]",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1, 10_000),
    envvar="OUTBOX_FARM_CONCURRENCY",
    default=None,
    help="Override every handler's concurrency (handler runs at once "
    "per process). Connections do not grow with it. [env OUTBOX_FARM_CONCURRENCY]",
)
@click.option(
    "--queues",
    envvar="OUTBOX_FARM_QUEUES",
    default=None,
    help="Comma-separated subset of queues to run (default: all handlers). "
    "[env OUTBOX_FARM_QUEUES]",
)
@_seconds_option(
    "graceful-timeout",
    30.0,
    0,
    "Seconds running handlers get to finish on SIGTERM; keep systemd's TimeoutStopSec above it.",
)
@_seconds_option(
    "heartbeat-timeout",
    30.0,
    1,
    "A worker whose event loop is blocked this long is killed and replaced.",
)
@_seconds_option(
    "poll-interval",
    0.5,
    0.01,
    "Seconds between polls when idle (NOTIFY and due times wake workers sooner).",
)
@_seconds_option(
    "vacuum-interval",
    10.0,
    0,
    "Seconds between checks whether the outbox table needs a VACUUM, which one worker "
    "then runs (autovacuum wakes too rarely for a queue table under load); 0 leaves it to "
    "autovacuum. Needs table ownership or MAINTAIN.",
)
@click.option(
    "--dlq-retention",
    callback=duration,
    envvar="OUTBOX_FARM_DLQ_RETENTION",
    default=None,
    metavar="DURATION",
    help="Delete DLQ rows older than this (e.g. 30d, 12h), a few hundred at a time, from one "
    "worker once a minute. Default: keep them until you purge them "
    "(`outbox-farm dlq purge`). [env OUTBOX_FARM_DLQ_RETENTION]",
)
@click.option(
    "--metrics-bind",
    callback=_check_bind,
    metavar="HOST:PORT",
    # click ignores an empty environment variable; an environment file that says
    # OUTBOX_FARM_METRICS_BIND= means "off", so the default reads it itself.
    default=lambda: os.environ.get("OUTBOX_FARM_METRICS_BIND", "127.0.0.1:9464"),
    show_default="127.0.0.1:9464",
    envvar="OUTBOX_FARM_METRICS_BIND",
    help="host:port for /metrics and /healthz ([::1]:port for IPv6; port 0 picks a free one); "
    "empty to turn off. [env OUTBOX_FARM_METRICS_BIND]",
)
@click.option(
    "--metrics-dir",
    default=None,
    envvar="OUTBOX_FARM_METRICS_DIR",
    help="Directory of the farm's own for its per-process metric files, emptied at every "
    "start; one holding files the farm did not write is refused. Default: a new temporary "
    "one. The farm sets PROMETHEUS_MULTIPROC_DIR to it for its processes and never reads it, "
    "so a web app's metrics directory is left alone. [env OUTBOX_FARM_METRICS_DIR]",
)
@click.option(
    "--migrate/--no-migrate",
    "run_migrate",
    default=None,
    envvar="OUTBOX_FARM_MIGRATE",
    help="Apply migrations before starting (default: only for the embedded "
    "database). [env OUTBOX_FARM_MIGRATE]",
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    envvar="OUTBOX_FARM_LOG_FORMAT",
    help="One line per event, as text or JSON. [env OUTBOX_FARM_LOG_FORMAT]",
)
@click.option(
    "--log-level",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    default="INFO",
    show_default=True,
    envvar="OUTBOX_FARM_LOG_LEVEL",
    help="[env OUTBOX_FARM_LOG_LEVEL]",
)
@click.option(
    "--preload",
    is_flag=True,
    envvar="OUTBOX_FARM_PRELOAD",
    help="Fork workers from the app the arbiter imported at start, instead of each worker "
    "importing it afresh: faster forks, but SIGHUP then restarts the workers on the old "
    "code. [env OUTBOX_FARM_PRELOAD]",
)
@click.option(
    "--reload",
    is_flag=True,
    envvar="OUTBOX_FARM_RELOAD",
    help="Development: replace every worker when a .py file of the app changes. "
    "[env OUTBOX_FARM_RELOAD]",
)
def start(
    app: str,
    dsn: str | None,
    procs: int,
    concurrency: int | None,
    queues: str | None,
    graceful_timeout: float,
    heartbeat_timeout: float,
    poll_interval: float,
    vacuum_interval: float,
    dlq_retention: float | None,
    metrics_bind: str,
    metrics_dir: str | None,
    run_migrate: bool | None,
    log_format: str,
    log_level: str,
    preload: bool,
    reload: bool,
) -> None:
    """Run the farm APP (`package.module:farm`; env OUTBOX_FARM_APP) in N supervised worker
    processes.

    The arbiter imports APP and checks the database once, then forks --procs workers (each
    imports APP again from disk unless --preload), restarts any that die, and serves /metrics
    and /healthz. SIGTERM/SIGINT drain gracefully, SIGQUIT stops at once, SIGHUP replaces every
    worker one at a time with one running the code now on disk, SIGTTIN/SIGTTOU add or remove
    one.
    """
    import dataclasses

    from .app import AppLoader
    from .farm import Farm
    from .logs import configure

    configure(log_format, log_level)
    _prepare_metrics_dir(metrics_dir)

    def adjust(farm: Farm) -> Farm:
        if concurrency is not None:
            farm.handlers = {
                q: dataclasses.replace(spec, concurrency=concurrency)
                for q, spec in farm.handlers.items()
            }
        return farm

    loader = AppLoader(app, adjust)
    try:
        farm = loader.load()
    except OutboxFarmError as exc:
        raise click.ClickException(str(exc)) from None
    selected = [q.strip() for q in queues.split(",") if q.strip()] if queues else None
    unknown = sorted(set(selected or ()) - set(farm.handlers))
    if unknown:
        raise click.UsageError(f"--queues names queues with no handler: {', '.join(unknown)}")
    cli_log = logging.getLogger("outbox_farm.cli")
    with _database(dsn, lambda line: cli_log.info(line, extra={"event": "embedded"})) as url:
        with _connect(url) as conn:
            _ready(conn, farm.names, run_migrate or (run_migrate is None and not dsn), cli_log)
        from .arbiter import Arbiter
        from .settings import RuntimeSettings, SupervisorSettings

        with tempfile_dir() as state:
            settings = SupervisorSettings(
                procs=procs,
                graceful_timeout=graceful_timeout,
                heartbeat_timeout=heartbeat_timeout,
                metrics_bind=metrics_bind or None,
                preload=preload,
                reload=reload,
                runtime=RuntimeSettings(
                    poll_interval=poll_interval,
                    queues=tuple(selected) if selected else None,
                    vacuum_interval=vacuum_interval,
                    dlq_retention=dlq_retention,
                ),
            )
            arbiter = Arbiter(farm, url, state, settings, loader)
            try:
                code = arbiter.run()
            except OutboxFarmError as exc:
                raise click.ClickException(str(exc)) from None
    sys.exit(code)


@contextmanager
def tempfile_dir() -> Iterator[Any]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="outbox-farm-state-") as folder:
        yield Path(folder)


from .ops_cli import register as register_operator_commands  # noqa: E402

register_operator_commands(main)


if __name__ == "__main__":
    main()
