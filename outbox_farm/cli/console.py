"""`outbox-farm console`: the web console, on loopback unless a token protects it.

Starlette, Jinja2 and uvicorn are imported inside the command only: `outbox-farm --help` and
every other command stay as fast as without them, and work when the `console` extra is not
installed. The access policy (loopback or token, CSRF, --read-only) is the console's own:
see `outbox_farm.console.security`.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING

import click

from ..admin.rates import DEFAULT_METRICS_URL
from ..errors import ConfigurationError
from ..names import TableNames
from ..ops.server import located
from ..settings import parse_bind
from .fleet_set import ALL_DATABASES, load_fleet, read_set
from .log_setup import configure
from .options import (
    EPILOG,
    dsn_or_embedded,
    log_format_option,
    table_options,
    tenant_dsn,
    tenant_options,
)
from .output import notice

if TYPE_CHECKING:
    from ..fleet import Fleet

DEFAULT_BIND = "127.0.0.1:9465"
EXTRA = "pip install 'outbox-farm[console]'"


@dataclass(frozen=True)
class WholeSet:
    """Serve every database of `fleet`'s set, its catalog (if any) on the home database."""

    fleet: Fleet
    home: str | None  # None: the embedded server is the home


def _target(
    dsn: str | None,
    dsn_file: str | None,
    embedded: bool,
    fleet: str | None,
    database: str | None,
) -> str | WholeSet | None:
    """What the console serves: with --fleet and no --database (or `--database all`), the
    fleet's whole set; else one database, as every command takes it."""
    if fleet is not None and database in (None, ALL_DATABASES):
        return WholeSet(load_fleet(fleet), dsn_or_embedded(dsn, dsn_file, embedded))
    return tenant_dsn(dsn, dsn_file, embedded, fleet, database)


# The DSN options of the one-database commands, but --fleet alone (or --database all) means
# the whole set: the console picks a database per page.
console_dsn_options = tenant_options(
    "target",
    _target,
    f"this database (without it, or with `{ALL_DATABASES}`, every database of the set: "
    "a picker on every page)",
)


@click.command(epilog=EPILOG)
@console_dsn_options
@table_options
@click.option(
    "--bind",
    default=DEFAULT_BIND,
    show_default=True,
    envvar="OUTBOX_FARM_CONSOLE_BIND",
    metavar="HOST:PORT",
    help="Where to serve the console (an IPv6 address in brackets: [::1]:9465). Any address "
    "but loopback needs --token-file, and TLS: --tls-cert/--tls-key, or --behind-tls-proxy. "
    "[env OUTBOX_FARM_CONSOLE_BIND]",
)
@click.option(
    "--token-file",
    default=None,
    envvar="OUTBOX_FARM_CONSOLE_TOKEN_FILE",
    metavar="PATH",
    help="Require a token on every request: the file holds one a line (at least 16 "
    "characters), `#` comments allowed. A line is `name:token` when it holds exactly one `:` "
    "after a name of letters, digits, `_`, `.` and `-`; any other line is a token, whole "
    "(named `token`). The name shows in the action log. Browsers log in with a form, scripts "
    "send `Authorization: Bearer TOKEN` (and need no CSRF token). "
    "[env OUTBOX_FARM_CONSOLE_TOKEN_FILE]",
)
@click.option(
    "--tls-cert",
    default=None,
    envvar="OUTBOX_FARM_CONSOLE_TLS_CERT",
    metavar="FILE",
    help="Serve HTTPS with this certificate chain (PEM); needs --tls-key. The session cookie "
    "is then Secure. [env OUTBOX_FARM_CONSOLE_TLS_CERT]",
)
@click.option(
    "--tls-key",
    default=None,
    envvar="OUTBOX_FARM_CONSOLE_TLS_KEY",
    metavar="FILE",
    help="The private key of --tls-cert (PEM). [env OUTBOX_FARM_CONSOLE_TLS_KEY]",
)
@click.option(
    "--behind-tls-proxy",
    is_flag=True,
    envvar="OUTBOX_FARM_CONSOLE_BEHIND_TLS_PROXY",
    help="A proxy in front terminates TLS: serve plain HTTP on a non-loopback --bind, and "
    "mark the session cookie Secure. Only when no client can reach the console but through "
    "that proxy. [env OUTBOX_FARM_CONSOLE_BEHIND_TLS_PROXY]",
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
@log_format_option("One line per event (every replay and purge included)")
@click.option(
    "--log-level",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    default="INFO",
    show_default=True,
    envvar="OUTBOX_FARM_LOG_LEVEL",
    help="[env OUTBOX_FARM_LOG_LEVEL]",
)
def console(
    target: str | WholeSet | None,
    names: TableNames,
    bind: str,
    token_file: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    behind_tls_proxy: bool,
    read_only: bool,
    metrics_url: str,
    sample_every: float,
    log_format: str,
    log_level: str,
) -> None:
    """A web console: queues, dead letters (find, read, replay, purge) and the farm's health.

    Serves on 127.0.0.1:9465 by default, open to this machine's users. Any other address
    refuses to start without --token-file, and without TLS: --tls-cert and --tls-key, or
    --behind-tls-proxy when a proxy in front terminates it (tokens and session cookies must
    not cross a network in cleartext). Every replay and purge shows a dry run and asks for
    confirmation, then acts on exactly the rows shown (or refuses), and is logged with who
    did it, the selection and the rows moved.
    With --read-only nothing can be changed.

    With --fleet APP (and no --database, or --database all) it serves every database of the
    fleet's set, read again every `recheck` seconds of the Fleet: an overview of them all at
    /, each database's pages under /db/NAME/, a picker on every page.
    """
    try:
        from ..console.app import ConsoleSettings
        from ..console.database import Database
        from ..console.security import Tokens, check_bind, check_transport
        from ..console.serve import Tls, serve
        from ..console.sets import DatabaseSet
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
    if (tls_cert is None) != (tls_key is None):
        raise click.UsageError("--tls-cert and --tls-key go together: give both, or neither")
    tls = Tls(tls_cert, tls_key) if tls_cert is not None and tls_key is not None else None
    if tls is not None:
        try:  # a bad file is reported here, in one line, not by uvicorn's traceback
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(tls.cert, tls.key)
        except (OSError, ssl.SSLError) as exc:
            raise click.BadParameter(
                f"cannot load {tls.cert} with {tls.key}: {exc}", param_hint="--tls-cert/--tls-key"
            ) from None
    try:
        check_bind(host, tokens)
        check_transport(host, tls is not None, behind_tls_proxy)
    except ConfigurationError as exc:
        raise click.UsageError(str(exc)) from None
    configure(log_format, log_level)

    def settings(database: Database | None, sets: DatabaseSet | None = None) -> ConsoleSettings:
        return ConsoleSettings(
            database=database,
            sets=sets,
            names=names,
            tokens=tokens,
            read_only=read_only,
            metrics_url=metrics_url.strip() or None,
            sample_every=sample_every,
            secure_cookie=tls is not None or behind_tls_proxy,
        )

    if isinstance(target, WholeSet):
        from ..fleet.databases import Sources

        with located(target.home, notice) as home:
            listing = read_set(target.fleet, home.url)  # its problems on stderr, once
            notice(
                f"console over the fleet's set: {len(listing.databases)} database(s), read "
                f"again every {target.fleet.recheck:g}s"
            )
            fleet = target.fleet
            databases = DatabaseSet(Sources(fleet.file, fleet.catalog, home.url), fleet.recheck)
            serve(settings(None, databases), host, port, tls)
        return
    with located(target, notice) as server:
        database = Database(server.url, server.name)
        with database.connection():
            pass  # an unreachable server fails here, as for every command, not on a page
        serve(settings(database), host, port, tls)
