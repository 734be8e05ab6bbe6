"""`outbox-farm console`: the web console, on loopback unless a token protects it.

Starlette, Jinja2 and uvicorn are imported inside the command only: `outbox-farm --help` and
every other command stay as fast as without them, and work when the `console` extra is not
installed. The access policy (loopback or token, CSRF, --read-only) is the console's own:
see `outbox_farm.console.security`.
"""

from __future__ import annotations

import click

from ..admin.rates import DEFAULT_METRICS_URL
from ..errors import ConfigurationError
from ..names import TableNames
from ..ops.log_setup import configure
from ..ops.server import located
from ..settings import parse_bind
from .options import EPILOG, dsn_options, table_options
from .output import notice

DEFAULT_BIND = "127.0.0.1:9465"
EXTRA = "pip install 'outbox-farm[console]'"


@click.command(epilog=EPILOG)
@dsn_options
@table_options
@click.option(
    "--bind",
    default=DEFAULT_BIND,
    show_default=True,
    envvar="OUTBOX_FARM_CONSOLE_BIND",
    metavar="HOST:PORT",
    help="Where to serve the console. Any address but loopback needs --token-file. "
    "[env OUTBOX_FARM_CONSOLE_BIND]",
)
@click.option(
    "--token-file",
    default=None,
    envvar="OUTBOX_FARM_CONSOLE_TOKEN_FILE",
    metavar="PATH",
    help="Require a token on every request: the file holds one a line, `name:token` or just "
    "the token (at least 16 characters); the name shows in the action log. Browsers log in "
    "with a form, scripts send `Authorization: Bearer TOKEN`. [env OUTBOX_FARM_CONSOLE_TOKEN_FILE]",
)
@click.option(
    "--read-only",
    is_flag=True,
    envvar="OUTBOX_FARM_CONSOLE_READ_ONLY",
    help="Show everything, change nothing: no replay or purge button, every action refused "
    "(403). [env OUTBOX_FARM_CONSOLE_READ_ONLY]",
)
@click.option(
    "--metrics-url",
    default=DEFAULT_METRICS_URL,
    show_default=True,
    envvar="OUTBOX_FARM_METRICS_URL",
    help="The running farm's /metrics (its /healthz is read beside it), for rates, p99 lag, "
    "the 15-minute chart, processes, restarts and relays; empty to leave them out. "
    "[env OUTBOX_FARM_METRICS_URL]",
)
@click.option(
    "--sample-every",
    type=click.FloatRange(0.2),
    default=5.0,
    show_default=True,
    envvar="OUTBOX_FARM_CONSOLE_SAMPLE_EVERY",
    help="Seconds between two readings of the farm's /metrics (the chart keeps 15 minutes). "
    "[env OUTBOX_FARM_CONSOLE_SAMPLE_EVERY]",
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    envvar="OUTBOX_FARM_LOG_FORMAT",
    help="One line per event (every replay and purge included), as text or JSON. "
    "[env OUTBOX_FARM_LOG_FORMAT]",
)
@click.option(
    "--log-level",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    default="INFO",
    show_default=True,
    envvar="OUTBOX_FARM_LOG_LEVEL",
    help="[env OUTBOX_FARM_LOG_LEVEL]",
)
def console(
    dsn: str | None,
    names: TableNames,
    bind: str,
    token_file: str | None,
    read_only: bool,
    metrics_url: str,
    sample_every: float,
    log_format: str,
    log_level: str,
) -> None:
    """A web console: queues, dead letters (find, read, replay, purge) and the farm's health.

    Serves on 127.0.0.1:9465 by default, open to this machine's users. Any other address
    refuses to start without --token-file. Every replay and purge shows a dry-run count and
    asks for confirmation, and is logged with who did it, the selection and the rows moved.
    With --read-only nothing can be changed.
    """
    try:
        from ..console.app import ConsoleSettings
        from ..console.database import Database
        from ..console.security import Tokens, check_bind
        from ..console.serve import serve
    except ImportError as exc:
        raise click.ClickException(
            f"the console needs packages that are not installed ({exc.name}): {EXTRA}"
        ) from None
    try:
        host, port = parse_bind(bind)
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc), param_hint="--bind") from None
    try:
        tokens = Tokens.load(token_file)
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc), param_hint="--token-file") from None
    try:
        check_bind(host, tokens)
    except ConfigurationError as exc:
        raise click.UsageError(str(exc)) from None
    configure(log_format, log_level)
    with located(dsn, notice) as server:
        database = Database(server.url, server.name)
        with database.connection():
            pass  # an unreachable server fails here, as for every command, not on a page
        settings = ConsoleSettings(
            database=database,
            names=names,
            tokens=tokens,
            read_only=read_only,
            metrics_url=metrics_url.strip() or None,
            sample_every=sample_every,
        )
        serve(settings, host, port)
