"""How `outbox-farm queue` shows a queue's controls: as JSON for scripts, and as the tables of
`queue list` (the controls, then the breakers at work).

Its own module because every `queue` command prints a queue's state the same way, and the
commands themselves are about what an operator may change and how the change is checked.
"""

from __future__ import annotations

from typing import Any

import click

from ..admin.queues import BreakerState, QueueState
from .output import text_table


def state_json(state: QueueState) -> dict[str, Any]:
    """A queue's controls as `--json` prints them: the rate as written (`6000/min`) and as a
    number per second, for scripts."""
    rate = state.limits.rate
    return {
        "queue": state.queue,
        "paused": state.paused,
        "paused_until": state.paused_until,
        "reason": state.reason,
        "changed_by": state.changed_by,
        "changed_at": state.changed_at,
        "rate": None if rate is None else str(rate),
        "rate_per_second": None if rate is None else rate.per_second,
        "max_running": state.limits.max_running,
        "key_max_running": state.limits.key_max_running,
        "breaker": breaker_json(state.breaker),
    }


def breaker_json(breaker: BreakerState) -> dict[str, Any]:
    """A queue's breaker as `--json` prints it: open or not, the failures counted in a row, and
    while open, since when, why and when its next probe may run."""
    return {
        "open": breaker.open,
        "failures": breaker.failures,
        "open_since": breaker.open_since,
        "reason": breaker.reason,
        "probe_at": breaker.probe_at,
    }


def local_time(value: Any) -> str:
    """A time in this machine's zone, with its offset, as the operator reads it; - for none."""
    return "-" if value is None else f"{value.astimezone():%Y-%m-%d %H:%M:%S %z}"


def _until(state: QueueState) -> str:
    if not state.paused:
        return "-"
    return "resumed" if state.paused_until is None else local_time(state.paused_until)


def _breaker(breaker: BreakerState) -> str:
    """A breaker in one cell: OPEN, failures counted so far, or -."""
    if breaker.open:
        return "OPEN"
    return f"{breaker.failures} failed" if breaker.failures else "-"


def print_tables(states: list[QueueState]) -> None:
    """`queue list`'s tables: every queue's controls, then the breakers that are open or
    counting failures, with how to close one."""
    rows = [
        [
            s.queue,
            "PAUSED" if s.paused else "-",
            _until(s),
            s.reason or "-",
            s.changed_by or "-",
            local_time(s.changed_at),
            "-" if s.limits.rate is None else str(s.limits.rate),
            "-" if s.limits.max_running is None else s.limits.max_running,
            "-" if s.limits.key_max_running is None else s.limits.key_max_running,
        ]
        for s in states
    ]
    headers = [
        "queue",
        "paused",
        "until",
        "reason",
        "changed by",
        "changed at",
        "rate",
        "max running",
        "per key",
    ]
    click.echo(text_table(headers, rows))
    breakers = [
        [
            s.queue,
            _breaker(s.breaker),
            local_time(s.breaker.open_since),
            local_time(s.breaker.probe_at),
            s.breaker.reason or "-",
        ]
        for s in states
        if s.breaker.open or s.breaker.failures
    ]
    if breakers:
        click.echo("")
        click.echo(
            "Breakers (an open one holds the queue on every farm but for one probe row each "
            "interval; close it with `outbox-farm queue close-breaker QUEUE`):"
        )
        headers = ["queue", "breaker", "open since", "next probe", "why"]
        click.echo(text_table(headers, breakers))
