"""The options several commands share, each defined once.

A bad value is refused as `usage_errors` says; the fleet's set that --fleet and --database
name a database of is read by `fleet_set`.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import Any, cast

import click

from ..admin import When, parse_duration
from ..names import TableNames
from ..ops.server import read_dsn_file
from .fleet_set import ALL_DATABASES, chosen, load_fleet, read_set
from .usage_errors import parsed, usage_error

EPILOG = "An option whose help ends in [env NAME] can also be set from that environment variable."
DSN_FILE_HINT = "'--dsn-file' / OUTBOX_FARM_DSN_FILE"

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


# `30d`, `12h`, `15m`, `45s` or plain seconds, as seconds.
duration = parsed(parse_duration)
# A duration ago (`2h`: two hours before the database's now) or an ISO-8601 time.
when = parsed(When.parse)


def group(*options: Decorator) -> Decorator:
    """Several options as one decorator, shown in --help in the order given."""

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):
            func = option(func)
        return func

    return decorate


def merged(into: str, build: Callable[..., Any], *options: Decorator) -> Decorator:
    """`options` handed to the command as one argument, `into`: `build` called with their
    values (its parameters are the options' names)."""
    keys = list(inspect.signature(build).parameters)

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def command(*args: Any, **kwargs: Any) -> Any:
            given = {key: kwargs.pop(key) for key in keys}
            return func(*args, **{into: build(**given)}, **kwargs)

        return group(*options)(command)

    return decorate


DSN_SOURCES = "--dsn, OUTBOX_FARM_DSN or --dsn-file"
# Where a connection string can come from, the file first: it keeps the password off every
# command line and out of the process's environment.
_DSN_PLACES = ("--dsn-file", "OUTBOX_FARM_DSN_FILE", "OUTBOX_FARM_DSN", "--dsn")
EMBEDDED_DIR = "./.outbox-farm/pgdata (OUTBOX_FARM_DATA_DIR)"


def _given(value: str | None, name: str, option: str, envvar: str) -> str | None:
    """`option` (from the command line or `envvar`), refused when it is blank: an empty
    variable is most often an environment file whose secret did not load. Taken as "no DSN",
    `demo` would run on the embedded server instead, and every other command would ask for a
    DSN the user believes is set. click drops an empty variable itself, so the environment is
    read here too. The message offers the other places, not the one that is blank."""
    if value is not None and value.strip():
        return value
    if value is None and envvar not in os.environ:
        return None
    source = click.get_current_context().get_parameter_source(name)
    blank = option if source is click.core.ParameterSource.COMMANDLINE else envvar
    where, fix = (
        (f"'{option}' is", "give the connection string after it, or drop it")
        if blank == option
        else (f"{envvar} is set but", "fill it in, or unset it")
    )
    others = [place for place in _DSN_PLACES if place != blank]
    raise click.BadParameter(
        f"{where} empty (a secret that did not load?): {fix} and use "
        f"{', '.join(others[:-1])} or {others[-1]} instead; the embedded server is not used in "
        "its place",
        param_hint=blank,
    )


def _dsn(dsn: str | None, dsn_file: str | None) -> str | None:
    dsn = _given(dsn, "dsn", "--dsn", "OUTBOX_FARM_DSN")
    dsn_file = _given(dsn_file, "dsn_file", "--dsn-file", "OUTBOX_FARM_DSN_FILE")
    if dsn and dsn_file:
        raise click.UsageError(
            "--dsn (OUTBOX_FARM_DSN) and --dsn-file (OUTBOX_FARM_DSN_FILE) are both set; keep one"
        )
    if not dsn_file:
        return dsn
    with usage_error(DSN_FILE_HINT):
        return read_dsn_file(dsn_file)


def dsn_or_embedded(dsn: str | None, dsn_file: str | None, embedded: bool) -> str | None:
    """The DSN, or None when --embedded asks for the embedded server: a command never starts
    that server unasked, since one created quietly in the working directory looks healthy
    while the real database waits (and `migrate` run after it migrates the wrong one)."""
    dsn = _dsn(dsn, dsn_file)
    if embedded and dsn:
        raise click.UsageError(f"--embedded and a DSN ({DSN_SOURCES}) are both given; keep one")
    if not embedded and not dsn:
        raise click.UsageError(
            "no database given: give its connection string with --dsn-file or "
            "OUTBOX_FARM_DSN_FILE (a file keeps the password off the command line), "
            "OUTBOX_FARM_DSN or --dsn; or pass --embedded to use the embedded PostgreSQL "
            f"server under {EMBEDDED_DIR}, for a try"
        )
    return dsn


def _dsn_option(without: str) -> Decorator:
    return click.option(
        "--dsn",
        envvar="OUTBOX_FARM_DSN",
        default=None,
        help="libpq connection string or postgresql:// URL; prefer OUTBOX_FARM_DSN or "
        "--dsn-file, since a command line is visible to every user of the machine. An empty "
        f"one is an error. {without} [env OUTBOX_FARM_DSN]",
    )


_dsn_file_option = click.option(
    "--dsn-file",
    envvar="OUTBOX_FARM_DSN_FILE",
    default=None,
    metavar="PATH",
    help="Read the connection string from this file (e.g. a container secret), so no "
    "password shows on the command line. [env OUTBOX_FARM_DSN_FILE]",
)


def _picked(
    dsn: str | None,
    dsn_file: str | None,
    embedded: bool,
    fleet: str | None,
    database: str | None,
) -> str | dict[str, str] | None:
    """The DSN; or with --database, from the set of the Fleet --fleet names (the DSN then
    being the fleet's home, where its catalog is), that database's DSN, or with `all` every
    database of the set by name."""
    home = dsn_or_embedded(dsn, dsn_file, embedded)
    if database is None:
        return home
    if fleet is None:
        raise click.UsageError(
            "--database picks a database of a fleet's set: name the Fleet with --fleet (or "
            "OUTBOX_FARM_FLEET), and give its home database as the DSN"
        )
    if home is None:
        raise click.UsageError("--database needs the fleet's home database as its DSN")
    databases = chosen(read_set(load_fleet(fleet), home), database)
    return databases if database == ALL_DATABASES else next(iter(databases.values()))


def tenant_dsn(
    dsn: str | None,
    dsn_file: str | None,
    embedded: bool,
    fleet: str | None,
    database: str | None,
) -> str | None:
    """`_picked`, for a command that works on one database."""
    if database == ALL_DATABASES:
        raise click.UsageError(
            "--database all is for `outbox-farm fleet migrate|check|stats`, `fleet doctor` "
            "and `dlq list|replay|purge`; this command works on one database: name it"
        )
    return cast("str | None", _picked(dsn, dsn_file, embedded, fleet, database))


# --dsn, --dsn-file and --embedded as the command's one `dsn` argument: the connection string,
# or None for the embedded server, which only --embedded asks for (neither is a usage error).
# The file (or the environment) keeps the password out of every process's command line. A
# blank one is refused, naming its source.
_embedded_option = click.option(
    "--embedded",
    is_flag=True,
    envvar="OUTBOX_FARM_EMBEDDED",
    help=f"Use the embedded PostgreSQL server under {EMBEDDED_DIR} instead of a DSN, "
    "started for the command and created on first use: for trying the farm out (`pip "
    "install 'outbox-farm[embedded]'`). [env OUTBOX_FARM_EMBEDDED]",
)
dsn_options = merged(
    "dsn",
    dsn_or_embedded,
    _dsn_option("Without any, --embedded is required."),
    _dsn_file_option,
    _embedded_option,
)

# --dsn and --dsn-file for `demo`, which runs on the embedded server when given neither: it
# makes tables of its own, so a throw-away server is what it is for.
demo_dsn_options = merged(
    "dsn",
    _dsn,
    _dsn_option(f"Without any, the embedded PostgreSQL server under {EMBEDDED_DIR}."),
    _dsn_file_option,
)


def _tables(table: str, dlq_table: str, no_dlq: bool) -> TableNames:
    with usage_error():
        return TableNames.build(table, None if no_dlq else dlq_table)


# --table, --dlq-table and --no-dlq as the command's one `names` argument, refused before
# anything connects.
table_options = merged(
    "names",
    _tables,
    click.option(
        "--table",
        default="outbox",
        show_default=True,
        envvar="OUTBOX_FARM_TABLE",
        help="Outbox table name, optionally schema.table. [env OUTBOX_FARM_TABLE]",
    ),
    click.option(
        "--dlq-table",
        default="outbox_dlq",
        show_default=True,
        envvar="OUTBOX_FARM_DLQ_TABLE",
        help="Dead-letter table name, optionally schema.table. [env OUTBOX_FARM_DLQ_TABLE]",
    ),
    click.option(
        "--no-dlq",
        is_flag=True,
        envvar="OUTBOX_FARM_NO_DLQ",
        help="Leave out the dead-letter table. [env OUTBOX_FARM_NO_DLQ]",
    ),
)


def seconds_option(name: str, default: float, minimum: float, text: str) -> Decorator:
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


def json_option(shape: str = "one object") -> Decorator:
    """--json, saying what the command prints: `shape` (e.g. "an array of rows")."""
    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        envvar="OUTBOX_FARM_JSON",
        help=f"Print JSON ({shape}) instead of text. [env OUTBOX_FARM_JSON]",
    )


def log_format_option(lines: str = "One line per event") -> Decorator:
    """--log-format, for the commands that run a while and log (`start`, `console`)."""
    return click.option(
        "--log-format",
        type=click.Choice(["text", "json"]),
        default="text",
        show_default=True,
        envvar="OUTBOX_FARM_LOG_FORMAT",
        help=f"{lines}, as text or JSON. [env OUTBOX_FARM_LOG_FORMAT]",
    )


_fleet_option = click.option(
    "--fleet",
    envvar="OUTBOX_FARM_FLEET",
    default=None,
    metavar="APP",
    help="The Fleet (`package.module:fleet`, as `start` takes it) whose set --database "
    "names a database of. [env OUTBOX_FARM_FLEET]",
)


def _database_option(which: str) -> Decorator:
    return click.option(
        "--database",
        envvar="OUTBOX_FARM_DATABASE",
        default=None,
        metavar="NAME",
        help=f"Work on {which} of --fleet's set, found through the fleet's home database (the "
        "DSN). [env OUTBOX_FARM_DATABASE]",
    )


_home_dsn_option = _dsn_option(
    "Without any, --embedded is required. With --database, the fleet's home."
)


def tenant_options(into: str, build: Callable[..., Any], which: str) -> Decorator:
    """--dsn/--dsn-file/--embedded, --fleet and --database, given to `build` as the command's
    one `into` argument; `which`: what --database names, for its help."""
    return merged(
        into,
        build,
        _home_dsn_option,
        _dsn_file_option,
        _embedded_option,
        _fleet_option,
        _database_option(which),
    )


# `dsn_options`, and a database of a fleet's set by its name: --fleet APP --database NAME, the
# DSN then being the fleet's home. For the commands that work on one database's tables.
tenant_dsn_options = tenant_options("dsn", tenant_dsn, "this database")

# The same, where --database all may name the whole set: `dsn` is then a dict of every
# database's DSN by its name, for the command to go over (see `over_set`).
tenant_set_options = tenant_options(
    "dsn", _picked, f"this database (or `{ALL_DATABASES}`: every database)"
)
