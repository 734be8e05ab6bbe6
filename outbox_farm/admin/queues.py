"""Pause, resume and limit queues: the operator's hand on every farm of an outbox at once.

The state lives in Postgres (`outbox_farm_queues`, one row per outbox and queue), so a change
reaches every farm on every host: each change commits with a NOTIFY on the farm's channel, on
which every farm reloads its controls, and every farm also reloads them every second, so one
that missed the NOTIFY follows within a second as well. A paused queue's fetchers claim nothing
more; the handlers already running finish and their outcomes are written. A farm started while
a queue is paused loads the pause before its first claim. A pause with an end (`until`, or
`seconds` from now) ends by itself on the database's clock, the one every farm reads it by.

Limits are farm-wide: a rate (`Rate`, a token bucket every process and host shares), a most
running at once, and a most running of each fair key (migration 0014). Setting one leaves the
others, and the pause, as they are.

A queue's breaker (the handler option `Breaker`) is the runtime's, not the operator's: failures
in a row open it and a probe's success closes it. The operator sees it here (`BreakerState`) and
may close an open one by hand (`close_breaker`), when the downstream is known to be back before
the next probe says so. There is no opening one by hand: that is a pause.

Every function takes a psycopg connection outside a transaction (each change is one
transaction of its own) and the farm's `TableNames`; the rows are keyed by the outbox table,
so two farms on two outboxes of one database keep apart. `by` is who made the change, kept
with it for `queue list` (the CLI passes `user@host`).
"""

from __future__ import annotations

import getpass
import socket
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from ..db import queue_controls as db
from ..db.connect import Connection
from ..errors import ConfigurationError
from ..limits import Limits, Rate
from ..names import TableNames
from .dlq import MAX_QUEUE

MAX_INT = 2**31 - 1  # the limits' columns are integers


class Unchanged:
    """The type of `UNCHANGED`: a limit `limit_queue` leaves as it is."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED: Final = Unchanged()


@dataclass(frozen=True, slots=True)
class BreakerState:
    """A queue's breaker as the farms keep it: `failures` counted in a row across every process
    (0 while open: the count starts again at its close), and while open, since when, why (the
    failure that opened it) and when its next probe may run (it may be past: no farm has taken
    the probe yet)."""

    failures: int = 0
    open_since: datetime | None = None
    reason: str | None = None
    probe_at: datetime | None = None

    @property
    def open(self) -> bool:
        """Open: every farm holds the queue but for one probe row each interval."""
        return self.open_since is not None


@dataclass(frozen=True, slots=True)
class QueueState:
    """The operator's controls of one queue. `paused` is paused now (a pause whose
    `paused_until` has passed is over, and reads False); `paused_until` is the end of the pause
    in force, None when it has none or the queue is not paused. `reason`: why it was paused (None
    once resumed); `changed_by` and `changed_at`: the last change of any control of it (an
    operator's; the breaker opening and closing by itself is not one). `breaker`: its breaker,
    closed and counting nothing for a queue without one."""

    queue: str
    paused: bool
    paused_until: datetime | None
    reason: str | None
    changed_by: str | None
    changed_at: datetime | None
    limits: Limits
    breaker: BreakerState = BreakerState()

    @classmethod
    def free(cls, queue: str) -> QueueState:
        """A queue without a row: not paused, not limited, never changed."""
        return cls(queue, False, None, None, None, None, Limits())


def operator() -> str:
    """Who runs this process, as `user@host`: the default author of a change."""
    try:
        user = getpass.getuser()
    except Exception:  # no user name in the environment nor the password database
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _state(row: db.ControlRow) -> QueueState:
    rate = None
    if row.rate_count is not None and row.rate_seconds is not None:
        rate = Rate(row.rate_count, row.rate_seconds)
    return QueueState(
        row.queue,
        row.paused,
        row.paused_until,
        row.reason,
        row.changed_by,
        row.changed_at,
        Limits(rate, row.max_running, row.key_max_running),
        BreakerState(
            row.breaker_failures,
            row.breaker_open_since,
            row.breaker_reason,
            row.breaker_probe_at,
        ),
    )


def check_queue(queue: str) -> str:
    """`queue` if it can name a queue (1 to 255 characters, no NUL); ConfigurationError."""
    if not isinstance(queue, str) or not queue or len(queue) > MAX_QUEUE or "\x00" in queue:
        raise ConfigurationError(
            f"a queue name is 1 to {MAX_QUEUE} characters without NUL characters, not "
            f"{str(queue)[:40]!r}{'...' if len(str(queue)) > 40 else ''}"
        )
    return queue


def _text(value: str | None, what: str) -> str | None:
    if value is not None and "\x00" in value:
        raise ConfigurationError(f"the {what} contains a NUL character; leave it out")
    return value


def queue_states(conn: Connection, names: TableNames) -> list[QueueState]:
    """Every queue of this outbox with a row of controls (paused, limited, or once so, or whose
    breaker is open, counting failures, or once did), by queue name. SchemaError when the
    database has no controls table (run migrate)."""
    return [_state(row) for row in db.read(conn, names)]


def queue_state(conn: Connection, names: TableNames, queue: str) -> QueueState:
    """`queue`'s controls; a queue never paused nor limited has none (`QueueState.free`)."""
    rows = db.read(conn, names, check_queue(queue))
    return _state(rows[0]) if rows else QueueState.free(queue)


def pause_queue(
    conn: Connection,
    names: TableNames,
    queue: str,
    *,
    until: datetime | None = None,
    reason: str | None = None,
    by: str | None = None,
    seconds: float | None = None,
) -> QueueState:
    """Pause `queue` on every farm of the outbox: until `until` (an aware time), for `seconds`
    from now on the database's clock, or until `resume_queue` (neither given). Every farm stops
    claiming it within a second; running handlers finish. Pausing a paused queue replaces its
    end, reason and author. Refused (ConfigurationError): both `until` and `seconds`, an end
    that has passed already (on the database's clock), a naive `until`, a bad queue name."""
    check_queue(queue)
    if until is not None and seconds is not None:
        raise ConfigurationError("give the pause's end as a time or as a duration, not both")
    if until is not None and until.tzinfo is None:
        raise ConfigurationError(
            f"the pause's end {until.isoformat()} has no time zone; give one (e.g. +00:00)"
        )
    if seconds is not None and not seconds > 0:
        raise ConfigurationError(
            f"a pause of {seconds:g}s ends before it starts; give a positive duration, or none "
            "to pause until resumed"
        )
    row = db.pause(
        conn,
        names,
        queue,
        until=until,
        seconds=seconds,
        reason=_text(reason, "reason"),
        by=_text(by, "author"),
    )
    if row is None:
        end = until.isoformat() if until is not None else "its end"
        raise ConfigurationError(
            f"{end} has passed already (on the database's clock): give a time in the future, "
            "or none to pause until resumed; nothing was changed"
        )
    return _state(row)


def resume_queue(
    conn: Connection, names: TableNames, queue: str, *, by: str | None = None
) -> QueueState:
    """End `queue`'s pause on every farm of the outbox: they claim it again within a second.
    Resuming a queue that is not paused changes nothing but the row's author and time."""
    row = db.resume(conn, names, check_queue(queue), by=_text(by, "author"))
    return QueueState.free(queue) if row is None else _state(row)


def limit_queue(
    conn: Connection,
    names: TableNames,
    queue: str,
    *,
    rate: Rate | Unchanged | None = UNCHANGED,
    max_running: int | Unchanged | None = UNCHANGED,
    key_max_running: int | Unchanged | None = UNCHANGED,
    by: str | None = None,
) -> QueueState:
    """Set `queue`'s farm-wide limits, across every process and host: at most `rate`, at most
    `max_running` rows running at once, and at most `key_max_running` of each fair key (a
    tenant: `publish(..., fair_key=...)`) at once. None clears that limit; `UNCHANGED` leaves
    it. A changed rate starts from a full bucket of the new rate. The farms apply the change
    within a second. Refused (ConfigurationError): a most running below 1 or above 2147483647,
    a count above it, a bad queue name. SchemaError when the database lacks the limits
    (migration 0012, and 0014 for `key_max_running`: run migrate)."""
    check_queue(queue)
    for name, most in (("max_running", max_running), ("key_max_running", key_max_running)):
        if isinstance(most, bool) or (isinstance(most, int) and not 1 <= most <= MAX_INT):
            raise ConfigurationError(
                f"{name} must be 1 to {MAX_INT} (or None to clear it), not {most}"
            )
    if isinstance(rate, Rate) and rate.count > MAX_INT:
        raise ConfigurationError(f"a rate's count must be at most {MAX_INT}, not {rate.count}")
    change = db.LimitChange(
        set_rate=not isinstance(rate, Unchanged),
        rate_count=rate.count if isinstance(rate, Rate) else None,
        rate_seconds=rate.seconds if isinstance(rate, Rate) else None,
        set_max=not isinstance(max_running, Unchanged),
        max_running=max_running if isinstance(max_running, int) else None,
        set_key_max=not isinstance(key_max_running, Unchanged),
        key_max_running=key_max_running if isinstance(key_max_running, int) else None,
    )
    return _state(db.limit(conn, names, queue, change, by=_text(by, "author")))


@dataclass(frozen=True, slots=True)
class ClosedBreaker:
    """What `close_breaker` did. `was_open`: the breaker was open and is closed now (False: it
    was not open, and nothing was changed); `since` and `reason`: the breaker as it was."""

    state: QueueState
    was_open: bool
    since: datetime | None = None
    reason: str | None = None


def close_breaker(
    conn: Connection, names: TableNames, queue: str, *, by: str | None = None
) -> ClosedBreaker:
    """Close `queue`'s open breaker now, on every farm of the outbox, as a probe's success
    would: they claim the queue again within a second, and its count of failures starts again
    (if the downstream still fails, the breaker opens again after its failures in a row).
    Closing a breaker that is not open (never was, or a probe closed it meanwhile) is no error:
    nothing is changed and `was_open` is False. SchemaError when the database lacks the
    breaker's columns (migration 0012: run migrate)."""
    closed = db.close_breaker(conn, names, check_queue(queue), by=_text(by, "author"))
    if closed.row is None:
        return ClosedBreaker(queue_state(conn, names, queue), False)
    return ClosedBreaker(_state(closed.row), True, closed.was_open_since, closed.was_reason)
