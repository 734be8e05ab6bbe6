"""The operator's commands: `stats`, `dlq list|show|replay|purge` and `doctor`.

They attach to the `outbox-farm` group through `register(main)`, and read the shared options
(--dsn, the table names) from `outbox_farm.cli` only when registered, so importing either
module first works. Every command has --json for scripts; text output is for people.
The work itself is done by `outbox_farm.admin`, the same API an admin script calls.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import click
import orjson

from .admin import When, parse_duration
from .admin.rates import DEFAULT_METRICS_URL
from .admin.stats import EXACT_LIMIT
from .db.connect import Connection
from .errors import OutboxFarmError
from .names import TableNames

RATE_WINDOW = 1.0  # seconds between the two scrapes of a one-shot `stats`


def duration(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    """Option callback: `30d`, `12h`, `15m`, `45s` or plain seconds, as seconds."""
    if value is None:
        return None
    try:
        return parse_duration(value)
    except OutboxFarmError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


def when(ctx: click.Context, param: click.Parameter, value: str | None) -> When | None:
    """Option callback: a duration ago (`2h`: two hours before the database's now) or an
    ISO-8601 time."""
    if value is None:
        return None
    try:
        return When.parse(value)
    except OutboxFarmError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


def json_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--json", "as_json", is_flag=True, help="Print JSON (one object) instead of text."
    )(func)


def echo_json(data: Any, compact: bool = False) -> None:
    """orjson: datetimes as RFC 3339, dataclasses as objects."""
    option = orjson.OPT_NON_STR_KEYS | (0 if compact else orjson.OPT_INDENT_2)
    click.echo(orjson.dumps(data, option=option).decode())


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned first column, right-aligned numbers, two spaces between columns."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [row[0].ljust(widths[0])]
        parts += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


@contextmanager
def session(dsn: str | None, names: TableNames) -> Iterator[Connection]:
    """An autocommit connection (replay and purge commit batch by batch), library errors
    turned into one-line messages."""
    from .cli import _connect, _database

    with _database(dsn) as url, _connect(url) as conn:
        conn.autocommit = True
        try:
            yield conn
        except OutboxFarmError as exc:
            raise click.ClickException(str(exc)) from None


def register(main: click.Group) -> None:
    """Add `stats`, `dlq` and `doctor` to the `outbox-farm` group."""
    from .ops_dlq_cli import add_dlq

    add_stats(main)
    add_dlq(main)
    add_doctor(main)


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h" if seconds < 172800 else f"{seconds / 86400:.1f}d"


def _n(count: Any) -> str:
    """A Count: exact as is, an estimate with `~`."""
    return str(count.value) if count.exact else f"~{count.value}"


def _render(frame: dict[str, Any]) -> str:
    from .admin.stats import OUTBOX_COUNTS

    rates = frame["farm"].get("queues", {})
    headers = ["queue", *(n.replace("_", " ") for n in OUTBOX_COUNTS), "oldest ready"]
    headers += ["dlq 1h", "dlq 1d", "dlq all"]
    if rates:
        headers += ["acked/s", "retries/s", "terminal/s", "p99 lag"]
    rows, reasons = [], []
    for q in frame["queues"]:
        row = [q.queue, *(_n(q.counts[n]) for n in OUTBOX_COUNTS), _age(q.oldest_ready_age)]
        row += [_n(q.dlq_total(w)) for w in ("last_hour", "last_day", "total")]
        if rates:
            r = rates.get(q.queue)
            lag = "-" if r is None or r.lag_p99 is None else _age(r.lag_p99)
            row += [f"{r.acked:.1f}", f"{r.retried:.1f}", f"{r.terminal:.1f}"] if r else ["-"] * 3
            row.append(lag)
        rows.append(row)
        reasons += [
            [q.queue, d.reason, _n(d.last_hour), _n(d.last_day), _n(d.total)] for d in q.dlq
        ]
    out = [table(headers, rows) if rows else "no rows in the outbox or the DLQ"]
    if reasons:
        out += ["", "DLQ by reason:", table(["queue", "reason", "1h", "1d", "all"], reasons)]
    farm = frame["farm"]
    if "error" in farm:
        out += ["", f"farm rates: {farm['error']}"]
    if any("~" in line for line in out):
        out += ["", "~ = the planner's estimate (too many rows to count one by one quickly)"]
    return "\n".join(out)


def add_stats(main: click.Group) -> None:
    from .cli import EPILOG, _dsn_option, _names, _table_options

    @main.command(epilog=EPILOG)
    @_dsn_option
    @_table_options
    @click.option("--queue", default=None, help="Only this queue (default: every queue).")
    @click.option(
        "--watch",
        callback=duration,
        default=None,
        metavar="SECONDS",
        help="Redraw every so many seconds (e.g. 2, 5s) until Ctrl-C, like `top`.",
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
        help="Count rows one by one up to this many per figure; above it, show the "
        "planner's estimate (marked ~).",
    )
    @json_option
    def stats(
        dsn: str | None,
        table: str,
        dlq_table: str,
        no_dlq: bool,
        queue: str | None,
        watch: float | None,
        metrics_url: str,
        exact_limit: int,
        as_json: bool,
    ) -> None:
        """Per queue: ready, scheduled, in flight, expired leases, retrying rows, the oldest
        ready row's age, DLQ rows by reason (last hour, day, all), and the running farm's rates.

        Counts are exact up to --exact-limit and the planner's estimate above it (marked ~ in
        text, "exact": false in JSON), so this answers in milliseconds on any table size.
        """
        from .admin import queue_stats
        from .admin.rates import Scrape, rates, scrape

        names = _names(table, dlq_table, no_dlq)

        def read_farm() -> Scrape | str:
            try:
                return scrape(metrics_url)
            except OutboxFarmError as exc:
                return str(exc)

        with session(dsn, names) as conn:
            before = read_farm() if metrics_url else None
            first = True
            try:
                while True:
                    queues = queue_stats(conn, names, queue, exact_limit)
                    farm: dict[str, Any] = {"url": metrics_url or None}
                    after: Scrape | str | None = None
                    if isinstance(before, str):
                        farm["error"] = before
                    elif before is not None:
                        if first:  # a rate needs time between its two readings
                            time.sleep(max(0.0, RATE_WINDOW - (time.monotonic() - before.at)))
                        after = read_farm()
                        if isinstance(after, str):
                            farm["error"] = after
                        else:
                            farm["window_seconds"] = round(after.at - before.at, 3)
                            farm["queues"] = rates(before, after)
                    frame = {"queues": queues, "farm": farm}
                    if as_json:
                        echo_json(frame, compact=watch is not None)
                    else:
                        if watch is not None and sys.stdout.isatty():
                            click.echo("\x1b[H\x1b[J", nl=False)  # home, clear: redraw in place
                        elif watch is not None and not first:
                            click.echo("")
                        click.echo(_render(frame))
                    if watch is None:
                        return
                    if metrics_url:
                        before = after if isinstance(after, Scrape) else read_farm()
                    first = False
                    time.sleep(watch)
            except KeyboardInterrupt:
                click.echo("", err=True)  # Ctrl-C ends --watch: a clean exit, status 0


def add_doctor(main: click.Group) -> None:
    from .cli import EPILOG, _connect, _database, _dsn_option, _names, _table_options

    @main.command(epilog=EPILOG)
    @_dsn_option
    @_table_options
    @click.option(
        "--max-xmin-age",
        callback=duration,
        default="5m",
        show_default=True,
        help="FAIL when a transaction has held back VACUUM (the xmin horizon) for longer.",
    )
    @click.option(
        "--max-lag",
        callback=duration,
        default="60s",
        show_default=True,
        help="WARN when the oldest ready row has waited longer than this since it was due.",
    )
    @json_option
    def doctor(
        dsn: str | None,
        table: str,
        dlq_table: str,
        no_dlq: bool,
        max_xmin_age: float,
        max_lag: float,
        as_json: bool,
    ) -> None:
        """Check that this database can run a farm well, and say what to do where it cannot.

        Connection and server version, the schema and this role's privileges, track_counts and
        autovacuum, the NOTIFY queue, each table's size and dead rows, the oldest transaction
        holding back VACUUM, and how long the oldest ready row has waited. Each line is OK,
        WARN or FAIL; exit status 1 when any is FAIL.
        """
        from .admin.doctor import Check, Limits, Status
        from .admin.doctor import doctor as run_doctor

        names = _names(table, dlq_table, no_dlq)
        with _database(dsn) as url:
            try:
                conn = _connect(url)
            except click.ClickException as exc:
                checks = [
                    Check(
                        "connection",
                        Status.FAIL,
                        exc.message,
                        "fix the DSN or start the server, then run doctor again",
                    )
                ]
            else:
                with conn:
                    conn.autocommit = True
                    checks = run_doctor(conn, names, Limits(max_xmin_age, max_lag))
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
