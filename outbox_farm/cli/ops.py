"""`stats` and `doctor`: how the farm's tables are doing, and whether the database suits it.

Both have --json for scripts; text output is for people. The work is done by
`outbox_farm.admin`, the same API an admin script calls.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from ..admin.doctor import Check, Limits, Status, doctor
from ..admin.frames import stats_frames
from ..admin.rates import DEFAULT_METRICS_URL
from ..admin.stats import CAUSES_PER_QUEUE, EXACT_LIMIT, OUTBOX_COUNTS, STALL_AFTER
from ..db.connect import connect
from ..errors import OutboxFarmError
from ..fleet.fleet import Fleet
from ..names import TableNames
from ..ops.server import connected, located
from ..prefork.app import load_farm
from .options import EPILOG, duration, json_option, table_options, tenant_dsn_options
from .output import echo_json, notice, text_table


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h" if seconds < 172800 else f"{seconds / 86400:.1f}d"


def _n(count: Any) -> str:
    """A Count: exact as is, an estimate with `~`."""
    return str(count.value) if count.exact else f"~{count.value}"


def _pause(q: Any) -> str:
    """A queue's pause in one cell: until when, and why."""
    if not q.paused:
        return "-"
    end = (
        "until resumed"
        if q.paused_until is None
        else f"until {q.paused_until:%Y-%m-%d %H:%M:%S %Z}"
    )
    return f"{end} ({q.pause_reason})" if q.pause_reason else end


def _breaker(q: Any) -> str:
    """A queue's breaker in one cell: open since when, why, the next probe; or the failures
    counted in a row."""
    b = q.breaker
    if b.open_since is None:
        return f"{b.failures} failure(s) in a row" if b.failures else "-"
    why = f" ({b.reason})" if b.reason else ""
    probe = "" if b.probe_at is None else f", next probe {b.probe_at:%Y-%m-%d %H:%M:%S %Z}"
    return f"open since {b.open_since:%Y-%m-%d %H:%M:%S %Z}{why}{probe}"


def _queues_of(app: str, names: TableNames) -> list[str]:
    """The queues `app` registers on the outbox `names` says: of a Fleet, its farm of that
    table."""
    loaded = load_farm(app)
    if not isinstance(loaded, Fleet):
        return list(loaded.handlers)
    return [q for f in loaded.farms if f.names.outbox == names.outbox for q in f.handlers]


def _render(frame: dict[str, Any]) -> str:
    rates = frame["farm"].get("queues", {})
    headers = ["queue", *(n.replace("_", " ") for n in OUTBOX_COUNTS), "oldest ready"]
    headers += ["dlq 1h", "dlq 1d", "dlq all", "breaker", "paused", "stalled"]
    if rates:
        headers += ["acked/s", "retries/s", "terminal/s", "p99 lag"]
    rows, reasons, stalls, causes, controls = [], [], [], [], []
    for q in frame["queues"]:
        row = [q.queue, *(_n(q.counts[n]) for n in OUTBOX_COUNTS), _age(q.oldest_ready_age)]
        row += [_n(q.dlq_total(w)) for w in ("last_hour", "last_day", "total")]
        row.append("OPEN" if q.breaker.open_since is not None else "-")
        row.append("PAUSED" if q.paused else "-")
        row.append("STALLED" if q.stalled else "-")
        if q.paused or q.limits or q.breaker.open_since is not None or q.breaker.failures:
            limits = str(q.limits) if q.limits else "-"
            controls.append([q.queue, _pause(q), limits, _breaker(q)])
        if q.stalled:
            stalls.append(f"{q.queue}: {q.stalled}")
        if rates:
            r = rates.get(q.queue)
            lag = "-" if r is None or r.lag_p99 is None else _age(r.lag_p99)
            row += [f"{r.acked:.1f}", f"{r.retried:.1f}", f"{r.terminal:.1f}"] if r else ["-"] * 3
            row.append(lag)
        rows.append(row)
        reasons += [
            [q.queue, d.reason, _n(d.last_hour), _n(d.last_day), _n(d.total)] for d in q.dlq
        ]
        causes += [[q.queue, g.rows, g.cause, ", ".join(g.reasons)] for g in q.causes]
    out = [text_table(headers, rows) if rows else "no rows in the outbox or the DLQ"]
    if stalls:
        out += ["", *stalls]
    if controls:
        out += [
            "",
            "Paused and limited queues, and breakers (farm-wide; change with outbox-farm queue "
            "pause|resume|limit|close-breaker):",
            text_table(["queue", "paused", "limits", "breaker"], controls),
        ]
    if reasons:
        out += ["", "DLQ by reason:", text_table(["queue", "reason", "1h", "1d", "all"], reasons)]
    if causes:
        out += [
            "",
            f"DLQ top causes ({CAUSES_PER_QUEUE} a queue; all of them: outbox-farm dlq list "
            "--group):",
            text_table(["queue", "rows", "cause", "reasons"], causes),
        ]
    farm = frame["farm"]
    if "error" in farm:
        out += ["", f"farm rates: {farm['error']}"]
    if any("~" in line for line in out):
        out += ["", "~ = the planner's estimate (too many rows to count one by one quickly)"]
    return "\n".join(out)


@click.command(epilog=EPILOG)
@tenant_dsn_options
@table_options
@click.option(
    "--queue",
    default=None,
    envvar="OUTBOX_FARM_QUEUE",
    help="Only this queue (default: every queue). [env OUTBOX_FARM_QUEUE]",
)
@click.option(
    "--watch",
    callback=duration,
    default=None,
    metavar="SECONDS",
    envvar="OUTBOX_FARM_WATCH",
    help="Redraw every so many seconds (e.g. 2, 5s) until Ctrl-C, like `top`. "
    "[env OUTBOX_FARM_WATCH]",
)
@click.option(
    "--metrics-url",
    default=DEFAULT_METRICS_URL,
    show_default=True,
    envvar="OUTBOX_FARM_METRICS_URL",
    help="The running farm's /metrics, for acked/s, retries/s, terminal/s and p99 lag "
    "(read twice, a second apart); empty to leave them out. [env OUTBOX_FARM_METRICS_URL]",
)
@click.option(
    "--exact-limit",
    type=click.IntRange(0),
    default=EXACT_LIMIT,
    show_default=True,
    envvar="OUTBOX_FARM_EXACT_LIMIT",
    help="Count rows one by one up to this many per figure; above it, show the "
    "planner's estimate (marked ~). [env OUTBOX_FARM_EXACT_LIMIT]",
)
@click.option(
    "--app",
    default=None,
    metavar="APP",
    envvar="OUTBOX_FARM_APP",
    help="The farm's app (`package.module:farm`, as `start` takes it): its registered queues "
    "are shown even when they have no rows. [env OUTBOX_FARM_APP]",
)
@json_option("one object; with --watch, one a line per redraw")
def stats(
    dsn: str | None,
    names: TableNames,
    queue: str | None,
    watch: float | None,
    metrics_url: str,
    exact_limit: int,
    app: str | None,
    as_json: bool,
) -> None:
    """Per queue: ready, scheduled, waiting (deep in an ordering key's line), in flight,
    expired leases, retrying rows, the oldest ready row's age, DLQ rows by reason (last hour,
    day, all) and its top causes, whether it is paused, its farm-wide limits and its breaker
    (`outbox-farm queue`), whether it is stalled, and the running farm's rates.

    The queues are those with rows, those the running farm serves (read from --metrics-url)
    and those --app registers: an idle queue shows with zeros.

    Counts are exact up to --exact-limit and the planner's estimate above it (marked ~ in
    text, "exact": false in JSON), so this answers in milliseconds on any table size.
    STALLED ("stalled" in JSON, the reason): a row has been claimable for over 60s (the
    farm's own threshold) while none of the queue's rows is leased, so nobody is working on
    it. A paused queue is never stalled, nor one whose breaker is open (OPEN, "breaker" in
    JSON: open_since non-null; its rows wait for the downstream, one probe row each
    interval). A queue whose claims fail is found by `outbox-farm doctor`, which probes them.
    """
    known = _queues_of(app, names) if app else []
    with connected(dsn, notice, autocommit=True) as conn:
        frames = stats_frames(
            conn,
            names,
            queue=queue,
            exact_limit=exact_limit,
            metrics_url=metrics_url,
            every=watch,
            known=known,
        )
        try:
            for number, frame in enumerate(frames):
                if as_json:
                    echo_json(frame, compact=watch is not None)
                    continue
                if watch is not None and sys.stdout.isatty():
                    click.echo("\x1b[H\x1b[J", nl=False)  # home, clear: redraw in place
                elif number:
                    click.echo("")
                click.echo(_render(frame))
        except KeyboardInterrupt:
            # Ctrl-C ends --watch: a clean exit, status 0. It may have come mid-query, with the
            # connection still busy: leaving the block would send it COMMIT, which fails
            # ("another command is already in progress"). Nothing here writes, so the
            # connection is dropped instead: leaving the block then sends nothing.
            conn.close()
            click.echo("", err=True)


@click.command(name="doctor", epilog=EPILOG)
@tenant_dsn_options
@table_options
@click.option(
    "--max-xmin-age",
    callback=duration,
    default="5m",
    show_default=True,
    envvar="OUTBOX_FARM_MAX_XMIN_AGE",
    help="FAIL when a transaction has held back VACUUM (the xmin horizon) for longer. "
    "[env OUTBOX_FARM_MAX_XMIN_AGE]",
)
@click.option(
    "--max-lag",
    callback=duration,
    default="60s",
    show_default=True,
    envvar="OUTBOX_FARM_MAX_LAG",
    help="WARN when the oldest ready row has waited longer than this since it was due. "
    "[env OUTBOX_FARM_MAX_LAG]",
)
@click.option(
    "--max-stall",
    callback=duration,
    default=f"{STALL_AFTER:g}s",
    show_default=True,
    envvar="OUTBOX_FARM_MAX_STALL",
    help="FAIL when a queue's oldest claimable row has waited longer than this while none "
    "of its rows is leased (no farm works on it). [env OUTBOX_FARM_MAX_STALL]",
)
@json_option('one object: "ok" and the "checks"')
def doctor_command(
    dsn: str | None,
    names: TableNames,
    max_xmin_age: float,
    max_lag: float,
    max_stall: float,
    as_json: bool,
) -> None:
    """Check that this database can run a farm well, and say what to do where it cannot.

    Connection and server version, the schema and this role's privileges, track_counts and
    autovacuum, the NOTIFY queue, each table's size and dead rows, the oldest transaction
    holding back VACUUM, how long the oldest ready row has waited, and stalled queues. Each
    line is OK, WARN or FAIL; exit status 1 when any is FAIL.

    A queue is stalled when its claim fails (doctor runs the farm's claim statement on it in
    a transaction it rolls back: nothing is changed) or when a row has been claimable for
    longer than --max-stall while none of its rows is leased. Run doctor as the farm's role:
    the probe claims with this role's privileges.
    """
    with located(dsn, notice) as server:
        try:
            conn = connect(server.url, autocommit=True, name=server.name)
        except OutboxFarmError as exc:  # the first finding, not an error of the command
            hint = "fix the DSN or start the server, then run doctor again"
            checks = [Check("connection", Status.FAIL, str(exc), hint)]
        else:
            with conn:
                checks = doctor(conn, names, Limits(max_xmin_age, max_lag, max_stall))
    failed = any(c.status is Status.FAIL for c in checks)
    if as_json:
        echo_json({"ok": not failed, "checks": checks})
    else:
        for check in checks:
            click.echo(f"{check.status.value:4} {check.name}: {check.detail}")
            if check.hint:
                click.echo(f"     -> {check.hint}")
    if failed:
        sys.exit(1)
