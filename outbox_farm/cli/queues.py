"""`outbox-farm queue pause|resume|limit|close-breaker|list`: the operator's hand on a queue, on
every farm.

Each change is written to the database the farms share and announced to them in the same
transaction: every farm of the outbox, on every host, follows within a second (running handlers
finish). The work is done by `outbox_farm.admin.queues`, the API an admin script or the console
calls.
"""

from __future__ import annotations

from typing import Any

import click

from ..admin import When
from ..admin.queues import (
    UNCHANGED,
    QueueState,
    Unchanged,
    close_breaker,
    limit_queue,
    operator,
    pause_queue,
    queue_state,
    queue_states,
    resume_queue,
)
from ..limits import Rate, parse_rate
from ..names import TableNames
from ..ops.server import connected
from .options import (
    EPILOG,
    duration,
    json_option,
    table_options,
    tenant_dsn_options,
    when,
)
from .output import echo_json, notice
from .queue_views import local_time, print_tables, state_json
from .usage_errors import usage_error

FARMS_STOP = "every farm stops claiming it within a second; running handlers finish"
FARMS_GO = "every farm claims it again within a second"
NONE = "none"

queue_argument = click.argument("queue")
by_option = click.option(
    "--by",
    default=None,
    metavar="NAME",
    envvar="OUTBOX_FARM_QUEUE_BY",
    help="Who makes the change, kept with it and shown by `queue list` (default: your user "
    "name @ this host). [env OUTBOX_FARM_QUEUE_BY]",
)


def _pause_line(state: QueueState) -> str:
    end = (
        "until resumed" if state.paused_until is None else f"until {local_time(state.paused_until)}"
    )
    why = f" ({state.reason})" if state.reason else ""
    return (
        f"paused queue {state.queue} {end}{why}: {FARMS_STOP}. "
        f"Resume it with `outbox-farm queue resume {state.queue}`."
    )


@click.group(epilog=EPILOG)
def queue() -> None:
    """Pause, resume and limit queues on every farm of the outbox at once, and close a
    queue's open breaker.

    The state lives in the database: every farm on every host follows a change within a
    second, and a farm started later starts with it. `list` shows what is in force.
    """


@queue.command(epilog=EPILOG)
@tenant_dsn_options
@table_options
@queue_argument
@click.option(
    "--until",
    "until",
    callback=when,
    default=None,
    metavar="WHEN",
    help="End the pause by itself at this ISO-8601 time (e.g. 2024-05-01T12:00:00+00:00; "
    "without a zone, this machine's), or after a duration from now (e.g. 15m, 2h). "
    "Default: paused until resumed.",
)
@click.option(
    "--for",
    "for_",
    callback=duration,
    default=None,
    metavar="DURATION",
    help="End the pause by itself after this long (e.g. 30s, 10m, 2h), on the database's clock.",
)
@click.option("--reason", default=None, help="Why, shown by `queue list` and `stats`.")
@by_option
@json_option("the queue's controls after the change")
def pause(
    dsn: str | None,
    names: TableNames,
    queue: str,
    until: When | None,
    for_: float | None,
    reason: str | None,
    by: str | None,
    as_json: bool,
) -> None:
    """Stop every farm claiming QUEUE's rows, within a second; running handlers finish.

    Rows keep arriving and wait, in order, until `queue resume` (or the end given by --until
    or --for). Pausing a paused queue sets its end and reason anew.
    """
    if until is not None and for_ is not None:
        raise click.UsageError("give --until or --for, not both: they both say when the pause ends")
    at = until.at if until is not None else None
    seconds = until.ago if until is not None and until.ago is not None else for_
    with usage_error(), connected(dsn, notice, autocommit=True) as conn:
        state = pause_queue(
            conn, names, queue, until=at, seconds=seconds, reason=reason, by=by or operator()
        )
    if as_json:
        echo_json(state_json(state))
        return
    click.echo(_pause_line(state))


@queue.command(epilog=EPILOG)
@tenant_dsn_options
@table_options
@queue_argument
@by_option
@json_option("the queue's controls after the change")
def resume(dsn: str | None, names: TableNames, queue: str, by: str | None, as_json: bool) -> None:
    """Let every farm claim QUEUE's rows again, within a second."""
    with usage_error(), connected(dsn, notice, autocommit=True) as conn:
        before = queue_state(conn, names, queue)
        state = resume_queue(conn, names, queue, by=by or operator())
    if as_json:
        echo_json(state_json(state))
    elif before.paused:
        click.echo(f"resumed queue {queue}: {FARMS_GO}.")
    else:
        click.echo(f"queue {queue} was not paused; the farms claim it as before.")


def _limit(parse: Any) -> Any:
    """An option callback: `none` clears the limit (None), no value leaves it (UNCHANGED)."""

    def callback(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
        if value is None:
            return UNCHANGED
        if value.strip().lower() == NONE:
            return None
        try:
            return parse(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc), ctx, param) from None

    return callback


def _most(text: str) -> int:
    try:
        most = int(text)
    except ValueError:
        raise ValueError(
            f"{text!r} is not a whole number; give one of 1 or more, or none"
        ) from None
    if most < 1:
        raise ValueError(f"{most} would run nothing; give 1 or more, or none to clear the limit")
    return most


@queue.command(epilog=EPILOG)
@tenant_dsn_options
@table_options
@queue_argument
@click.option(
    "--rate",
    callback=_limit(parse_rate),
    default=None,
    metavar="RATE|none",
    help="At most this many rows per unit of time, farm-wide (e.g. 100/s, 6000/min, 50/h, "
    "5/10s); none clears it.",
)
@click.option(
    "--max-running",
    callback=_limit(_most),
    default=None,
    metavar="N|none",
    help="At most this many of its rows running at once, farm-wide; none clears it.",
)
@click.option(
    "--per-key-running",
    "key_max_running",
    callback=_limit(_most),
    default=None,
    metavar="N|none",
    help="At most this many rows of each fair key (a tenant: publish(..., fair_key=...)) "
    "running at once, farm-wide; rows without a fair key count as one key. none clears it.",
)
@click.option("--clear", is_flag=True, help="Clear every limit.")
@by_option
@json_option("the queue's controls after the change")
def limit(
    dsn: str | None,
    names: TableNames,
    queue: str,
    rate: Rate | Unchanged | None,
    max_running: int | Unchanged | None,
    key_max_running: int | Unchanged | None,
    clear: bool,
    by: str | None,
    as_json: bool,
) -> None:
    """Limit QUEUE across every process and host: a rate, a most running at once, a most
    running per fair key, or any of them.

    A limit not given is left as it is; `none` clears one, --clear every one (the per-key
    limit only where the outbox has had migration 0014). Every farm applies the change within
    a second. A pause is left as it is.
    """
    limits = (rate, max_running, key_max_running)
    given = not all(isinstance(each, Unchanged) for each in limits)
    if clear and given:
        raise click.UsageError("give --clear alone: it clears every limit")
    if not clear and not given:
        raise click.UsageError(
            "say what to limit: --rate, --max-running, or --clear (--per-key-running for a "
            "most running per fair key)"
        )
    if clear:
        rate, max_running = None, None
    with usage_error(), connected(dsn, notice, autocommit=True) as conn:
        state = limit_queue(
            conn,
            names,
            queue,
            rate=rate,
            max_running=max_running,
            key_max_running=key_max_running,
            by=by or operator(),
        )
        if clear and state.limits.key_max_running is not None:  # only then has it 0014
            state = limit_queue(conn, names, queue, key_max_running=None, by=by or operator())
    if as_json:
        echo_json(state_json(state))
    elif state.limits:
        click.echo(
            f"limited queue {queue} to {state.limits}, farm-wide: every farm applies it within "
            "a second."
        )
    else:
        click.echo(
            f"queue {queue} has no limits now: every farm claims it unlimited within a second."
        )


@queue.command(name="close-breaker", epilog=EPILOG)
@tenant_dsn_options
@table_options
@queue_argument
@by_option
@json_option("the queue's controls after the change, with closed and the breaker as it was")
def close_breaker_(
    dsn: str | None, names: TableNames, queue: str, by: str | None, as_json: bool
) -> None:
    """Close QUEUE's open breaker now: every farm claims it again within a second.

    A breaker opens by itself when the queue's handler keeps failing, and a probe's success
    closes it; close it by hand when its downstream is back before the next probe says so.
    The count of failures starts again: should the downstream still fail, the breaker opens
    again after its failures in a row. To hold a queue by hand, pause it.
    """
    with usage_error(), connected(dsn, notice, autocommit=True) as conn:
        closed = close_breaker(conn, names, queue, by=by or operator())
    if as_json:
        was = {"closed": closed.was_open, "was_open_since": closed.since}
        echo_json(state_json(closed.state) | was | {"was_reason": closed.reason})
    elif closed.was_open:
        why = f": {closed.reason}" if closed.reason else ""
        click.echo(
            f"closed the breaker of queue {queue} (open since {local_time(closed.since)}{why}): "
            f"{FARMS_GO}. Should its handler keep failing, the breaker opens again."
        )
    else:
        failed = closed.state.breaker.failures
        counted = f" ({failed} failure(s) counted in a row)" if failed else ""
        click.echo(
            f"the breaker of queue {queue} is not open{counted}; nothing was changed, and the "
            "farms claim it as before."
        )


@queue.command(name="list", epilog=EPILOG)
@tenant_dsn_options
@table_options
@json_option("an array of queues, by name")
def list_(dsn: str | None, names: TableNames, as_json: bool) -> None:
    """Every queue of the outbox that is paused or limited, or ever was: paused now, until
    when, why, who changed it last and when, its rate, its most running at once and its most
    running of each fair key (`per key`). Then each queue whose breaker is open or counting
    failures: OPEN (since when, why, the next probe) or the failures counted in a row."""
    with connected(dsn, notice, autocommit=True) as conn:
        states = queue_states(conn, names)
    if as_json:
        echo_json([state_json(s) for s in states])
        return
    if not states:
        click.echo(
            "no queue of this outbox is paused or limited; `outbox-farm queue pause QUEUE` "
            "pauses one"
        )
        return
    print_tables(states)
