"""`outbox-farm fleet`: the databases of a Fleet app, who serves each, and their schema and
numbers, over the whole set or one database of it.

Every command takes the app (as `start` does: it knows the farms and where the set comes
from) and the home database (--dsn: the fleet's leases, and the catalog query's database).
Over the set, each database's line is printed as it is done, then a summary; one database that
fails is reported by name and the others still run; the exit status is 1 when any failed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from ..admin.doctor import Check, Status, doctor
from ..admin.stats import queue_stats
from ..db import fleet as statements
from ..db.connect import Connection, connect
from ..ops.migrate import migrate
from ..ops.readiness import schema_report
from ..ops.server import located
from .fleet_set import ALL_DATABASES, chosen, load_fleet, read_set
from .options import (
    EPILOG,
    dsn_options,
    json_option,
)
from .output import echo_json, notice, text_table
from .over_set import named, over


@contextmanager
def _home(dsn: str | None) -> Iterator[str]:
    with located(dsn, notice) as server:
        yield server.url


database_option = click.option(
    "--database",
    default=ALL_DATABASES,
    show_default=True,
    envvar="OUTBOX_FARM_DATABASE",
    metavar="NAME",
    help="One database of the set, by its name, or all of them. [env OUTBOX_FARM_DATABASE]",
)
app_argument = click.argument("app", envvar="OUTBOX_FARM_APP")


@click.group(epilog=EPILOG)
def fleet() -> None:
    """Many outboxes: the databases of a Fleet app, who serves them, their schema and numbers.

    APP is the Fleet `start` runs (`package.module:fleet`; env OUTBOX_FARM_APP); --dsn is its
    home database, which keeps the fleet's leases.
    """


@fleet.command(epilog=EPILOG)
@app_argument
@dsn_options
@json_option('one object: the "databases" with their holder, the "processes", "unserved"')
def status(app: str, dsn: str | None, as_json: bool) -> None:
    """Which process of which host serves each database of the set, and the fleet's live
    processes; exit status 1 while a database of the set is served by none."""
    fleet_ = load_fleet(app)
    with _home(dsn) as home:
        listing = read_set(fleet_, home)
        with connect(home, autocommit=True, name="the home database") as conn:
            leases = {a.database: a for a in statements.assignments(conn, fleet_.name)}
            processes = statements.processes(conn, fleet_.name)
    unserved = sorted(n for n in listing.databases if n not in leases or not leases[n].live)
    if as_json:
        echo_json(
            {
                "fleet": fleet_.name,
                "databases": [
                    {
                        "name": name,
                        "holder": leases[name].holder if name in leases else None,
                        "live": name in leases and leases[name].live,
                    }
                    for name in sorted(listing.databases)
                ],
                "processes": [p._asdict() for p in processes],
                "unserved": unserved,
                "problems": listing.problems,
            }
        )
    else:
        rows = []
        for name in sorted(listing.databases):
            lease = leases.get(name)
            if lease is None:
                rows.append([name, "-", "UNSERVED"])
            else:
                state = f"{lease.expires_in:.0f}s left" if lease.live else "EXPIRED"
                rows.append([name, lease.holder, state])
        click.echo(text_table(["database", "served by", "lease"], rows))
        click.echo("")
        since = [f"{p.started_at:%Y-%m-%d %H:%M:%S %Z}" for p in processes]
        click.echo(
            text_table(
                ["process", "databases", "since"],
                [[p.member, p.databases, s] for p, s in zip(processes, since, strict=True)],
            )
        )
        click.echo(
            f"\nfleet {fleet_.name}: {len(listing.databases)} databases, {len(processes)} "
            f"processes, {len(unserved)} unserved"
        )
    if unserved:
        sys.exit(1)


@fleet.command(name="migrate", epilog=EPILOG)
@app_argument
@dsn_options
@database_option
@click.option(
    "--repair",
    is_flag=True,
    envvar="OUTBOX_FARM_REPAIR",
    help="As `outbox-farm migrate --repair`, in every database. [env OUTBOX_FARM_REPAIR]",
)
@json_option('one object: "applied" per database, "failed" per database with why')
def migrate_command(app: str, dsn: str | None, database: str, repair: bool, as_json: bool) -> None:
    """Create or upgrade every farm's tables in the home database, then in each database of
    the set (or --database NAME), with a summary: which were migrated, which were up to date,
    which failed and why. Safe to run again, or on a set being served."""
    fleet_ = load_fleet(app)

    def work(conn: Connection) -> list[str]:
        applied: list[str] = []
        for farm in fleet_.farms:
            applied += migrate(conn, farm.names, repair=repair).applied
        return applied

    def say(name: str, applied: list[str]) -> str:
        return f"{len(applied)} applied" if applied else "up to date"

    with _home(dsn) as home:
        notice("migrating the home database")
        with connect(home, name="the home database") as conn:
            notice(f"  home: {say('home', work(conn))}")
        databases = chosen(read_set(fleet_, home), database)
        notice(f"migrating {len(databases)} database(s) of fleet {fleet_.name}")
        outcome = over(databases, work, say)
    migrated = sorted(n for n, applied in outcome.lines.items() if applied)
    if as_json:
        echo_json({"applied": outcome.lines, "failed": outcome.failed})
    else:
        click.echo(
            f"fleet migrate: {len(databases)} database(s): {len(migrated)} migrated, "
            f"{len(outcome.lines) - len(migrated)} up to date, {len(outcome.failed)} failed"
            + named(outcome.failed)
        )
    if outcome.failed:
        sys.exit(1)


@fleet.command(epilog=EPILOG)
@app_argument
@dsn_options
@database_option
@json_option('one object: "problems" per database (empty: OK), "failed" per database with why')
def check(app: str, dsn: str | None, database: str, as_json: bool) -> None:
    """`outbox-farm check` of every farm's tables in each database of the set (or --database
    NAME), with a summary: which are OK, which are behind or drifted (run `fleet migrate`),
    which could not be checked; exit status 1 unless all are OK."""
    fleet_ = load_fleet(app)

    def work(conn: Connection) -> list[str]:
        return [p for farm in fleet_.farms for p in schema_report(conn, farm.names).problems]

    def say(name: str, problems: list[str]) -> str:
        return "OK" if not problems else f"{len(problems)} problem(s): " + "; ".join(problems)

    with _home(dsn) as home:
        databases = chosen(read_set(fleet_, home), database)
        outcome = over(databases, work, say)
    behind = sorted(n for n, problems in outcome.lines.items() if problems)
    if as_json:
        echo_json({"problems": outcome.lines, "failed": outcome.failed})
    else:
        click.echo(
            f"fleet check: {len(databases)} database(s): {len(outcome.lines) - len(behind)} OK, "
            f"{len(behind)} with problems"
            + named(behind)
            + f", {len(outcome.failed)} not checked"
            + named(outcome.failed)
        )
    if behind or outcome.failed:
        sys.exit(1)


@fleet.command(epilog=EPILOG)
@app_argument
@dsn_options
@database_option
@json_option('one object: per database, per table, its queues\' figures; "failed" per database')
def stats(app: str, dsn: str | None, database: str, as_json: bool) -> None:
    """Per database of the set (or --database NAME), per table and queue: ready, in flight,
    retrying, DLQ rows, the oldest ready row's age, and whether it is paused or stalled (see
    `outbox-farm stats`, which --database's DSN also suits, for the whole picture)."""
    fleet_ = load_fleet(app)

    def work(conn: Connection) -> dict[str, Any]:
        return {
            str(farm.names.outbox): queue_stats(conn, farm.names, known=farm.handlers)
            for farm in fleet_.farms
        }

    def say(name: str, tables: dict[str, Any]) -> str:
        ready = sum(q.counts["ready"].value for qs in tables.values() for q in qs)
        return f"{ready} ready"

    with _home(dsn) as home:
        databases = chosen(read_set(fleet_, home), database)
        outcome = over(databases, work, say)
    if as_json:
        echo_json({"databases": outcome.lines, "failed": outcome.failed})
    else:
        rows = [
            [
                name,
                table,
                q.queue,
                q.counts["ready"].value,
                q.counts["in_flight"].value,
                q.counts["retrying"].value,
                q.dlq_total("total").value,
                f"{q.oldest_ready_age:.1f}s",
                "PAUSED" if q.paused else "STALLED" if q.stalled else "-",
            ]
            for name, tables in outcome.lines.items()
            for table, queues in tables.items()
            for q in queues
        ]
        headers = ["database", "table", "queue", "ready", "in flight", "retrying", "dlq"]
        click.echo(text_table([*headers, "oldest ready", "state"], rows))
        if outcome.failed:
            click.echo(f"\nnot read:{named(outcome.failed)}")
    if outcome.failed:
        sys.exit(1)


@fleet.command(name="doctor", epilog=EPILOG)
@app_argument
@dsn_options
@database_option
@json_option('one object: per database, its "checks"; "failed" per database with why')
def doctor_command(app: str, dsn: str | None, database: str, as_json: bool) -> None:
    """`outbox-farm doctor` of every farm's tables in each database of the set (or --database
    NAME): each database's FAIL and WARN lines, then a summary; exit status 1 when a check
    failed or a database could not be reached."""
    fleet_ = load_fleet(app)

    def work(conn: Connection) -> list[Check]:
        return [check for farm in fleet_.farms for check in doctor(conn, farm.names)]

    def say(name: str, checks: list[Check]) -> str:
        worst = [c for c in checks if c.status is not Status.OK]
        lines = "".join(f"\n    {c.status.value} {c.name}: {c.detail}" for c in worst)
        return ("OK" if not worst else f"{len(worst)} not OK") + lines

    with _home(dsn) as home:
        databases = chosen(read_set(fleet_, home), database)
        outcome = over(databases, work, say, autocommit=True)
    failing = sorted(
        n for n, checks in outcome.lines.items() if any(c.status is Status.FAIL for c in checks)
    )
    if as_json:
        echo_json({"checks": outcome.lines, "failed": outcome.failed})
    else:
        click.echo(
            f"fleet doctor: {len(databases)} database(s): {len(failing)} failing"
            + named(failing)
            + f", {len(outcome.failed)} unreachable"
            + named(outcome.failed)
        )
    if failing or outcome.failed:
        sys.exit(1)
