"""`outbox-farm start`: the farm, supervised by an arbiter in this process."""

from __future__ import annotations

import logging
import os
import sys

import click

from ..prefork.metrics_dir import prepare_metrics_dir
from ..settings import DEFAULT_BIND, RuntimeSettings, SupervisorSettings, parse_bind
from .log_setup import configure
from .options import (
    EPILOG,
    dsn_options,
    duration,
    log_format_option,
    seconds_option,
)
from .usage_errors import parsed, usage_error

METRICS_DIR_HINT = "'--metrics-dir' / OUTBOX_FARM_METRICS_DIR"


def _bind(text: str) -> str | None:
    """--metrics-bind, checked while the command line is read: a typo is a usage error naming
    the option, not a traceback from the arbiter (and a restart loop under a supervisor)."""
    text = text.strip()
    if text:
        parse_bind(text)
    return text or None


def _queues(text: str) -> tuple[str, ...] | None:
    return tuple(name for name in (part.strip() for part in text.split(",")) if name) or None


@click.command(epilog=EPILOG)
@click.argument("app", envvar="OUTBOX_FARM_APP")
@dsn_options
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
    callback=parsed(_queues),
    envvar="OUTBOX_FARM_QUEUES",
    default=None,
    help="Comma-separated subset of queues to run (default: all handlers). "
    "[env OUTBOX_FARM_QUEUES]",
)
@seconds_option(
    "graceful-timeout",
    30.0,
    0,
    "Seconds running handlers get to finish on SIGTERM; keep systemd's TimeoutStopSec above it.",
)
@seconds_option(
    "heartbeat-timeout",
    30.0,
    1,
    "A worker whose event loop is blocked this long is killed and replaced.",
)
@seconds_option(
    "poll-interval",
    0.5,
    0.01,
    "Seconds between polls when idle (NOTIFY and due times wake workers sooner).",
)
@seconds_option(
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
    callback=parsed(_bind),
    metavar="HOST:PORT",
    # click ignores an empty environment variable; an environment file that says
    # OUTBOX_FARM_METRICS_BIND= means "off", so the default reads it itself.
    default=lambda: os.environ.get("OUTBOX_FARM_METRICS_BIND", DEFAULT_BIND),
    show_default=DEFAULT_BIND,
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
    help="Apply migrations before starting (default: only with --embedded). "
    "[env OUTBOX_FARM_MIGRATE]",
)
@log_format_option()
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
    queues: tuple[str, ...] | None,
    graceful_timeout: float,
    heartbeat_timeout: float,
    poll_interval: float,
    vacuum_interval: float,
    dlq_retention: float | None,
    metrics_bind: str | None,
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
    worker one at a time with one running the code now on disk (for a Fleet: every worker reads
    the set again, and workers are replaced only when the code changed on disk), SIGTTIN/SIGTTOU
    add or remove one. --embedded runs it on the embedded PostgreSQL server instead of a DSN,
    migrated first: for a try.

    APP may also be an `outbox_farm.fleet.Fleet`: several outbox tables, in every database of
    a set (a TOML file, a catalog query), shared out among the workers of every host by leases
    in the database of --dsn, the fleet's home (`outbox-farm migrate` it first).
    """
    configure(log_format, log_level)
    with usage_error(METRICS_DIR_HINT):
        prepare_metrics_dir(metrics_dir)
    # Only now: nothing may import prometheus_client before its directory is set.
    from ..prefork.launch import load_app, run_farm

    settings = SupervisorSettings(
        procs=procs,
        graceful_timeout=graceful_timeout,
        heartbeat_timeout=heartbeat_timeout,
        metrics_bind=metrics_bind,
        preload=preload,
        reload=reload,
        runtime=RuntimeSettings(
            queues=queues,
            poll_interval=poll_interval,
            vacuum_interval=vacuum_interval,
            dlq_retention=dlq_retention,
        ),
    )
    with usage_error():
        loader, farm = load_app(app, concurrency, queues)
    log = logging.getLogger("outbox_farm.cli")
    sys.exit(run_farm(farm, loader, dsn, settings, run_migrate, log))
