"""Permanent database errors the runtime keeps running into, for logs and health checks.

A missing privilege, table or column does not go away by retrying, yet the runtime keeps
retrying (an operator may fix it any moment, and nothing is lost meanwhile). So that such a
state is neither silent nor a log flood, each one is logged at ERROR at most once a minute per
operation and kind, and the latest is exposed as `Runtime.problem` until the operation that
failed succeeds again. Only `PermanentError`s are problems: a lost connection or a refused
statement passes by itself, and is the caller's to log.

One kind of retrying costs more than log lines: a row whose outcome cannot be written (the
role lost DELETE, its transactions turned read-only) is claimed again when its lease expires
and its handler runs again, every lease, for nothing. So an ack or a retry refused for want of
a privilege pauses the claims of the row's queue: the queue is a problem (/healthz 503) until
its fetcher finds, by running the refused statement over no rows (which checks the same
privileges and changes nothing), that the write would pass again (see `pause`). A refused
dead-letter move pauses nothing: it concerns only the rows that fail for good, which stay in
the outbox and are reported as a problem, while the queue's healthy rows are delivered (a row's
own fault costs only that row).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from .errors import DatabaseError, PermanentError, PrivilegeError

LOG_EVERY = 60.0
READ_ONLY = "25006"  # read_only_sql_transaction: no write of this session can pass either
# The writes that end healthy rows' deliveries: refused, every handler runs again every lease.
PAUSING_WRITES = ("ack", "retry")
# Runs the refused write over no rows: the error it still gets, None once it would pass.
Probe = Callable[[], Awaitable[DatabaseError | None]]


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


class Problems:
    """The open problems of one runtime, by the operation that ran into them."""

    def __init__(self) -> None:
        self._open: dict[str, str] = {}
        self._logged: dict[tuple[str, str | None], float] = {}
        # Queues whose claims are paused: why, and the probe that tells when to resume. Written
        # by the completer (pause) and the queue's fetcher (resume), read by the fetcher.
        self.paused: dict[str, tuple[str, Probe]] = {}

    @property
    def current(self) -> str | None:
        """A paused queue (with the refused write: its cause), else the most recent open
        problem, as one line; None while there is none."""
        if self.paused:
            queue, (reason, _) = next(iter(self.paused.items()))
            return f"queue {queue}: claims paused, its rows' outcomes cannot be written: {reason}"
        if self._open:
            operation, reason = next(reversed(self._open.items()))
            return f"{operation}: {reason}"
        return None

    def write_refused(
        self,
        phase: str,
        queue: str,
        exc: DatabaseError,
        probe: Probe,
        logger: logging.Logger,
        extra: dict[str, object],
    ) -> bool:
        """A write of `phase` for a row of `queue` was refused with `exc`: recorded as `report`
        does (its result), and the queue's claims paused when that write is an ack or a retry
        and the refusal is for want of a privilege (`probe` tells when it would pass again)."""
        reported = self.report(f"{phase} write", exc, logger, extra)
        refused = isinstance(exc, PrivilegeError) or exc.sqlstate == READ_ONLY
        if refused and phase in PAUSING_WRITES and queue not in self.paused:
            self.paused[queue] = (f"{phase} write: {one_line(exc)}", probe)
            logger.error(
                "queue %s: claims paused, as its rows' %s writes are refused (%s): each row "
                "would run its handler again at every lease. Grant what is missing (`outbox-farm "
                "check` names it); claims resume on their own once the write passes",
                queue,
                phase,
                one_line(exc),
                extra={"event": "claims_paused", "queue": queue, "phase": phase},
            )
        return reported

    def resumed(self, queue: str, logger: logging.Logger) -> None:
        """The queue's refused write passes again: its claims resume."""
        if self.paused.pop(queue, None) is not None:
            logger.info(
                "queue %s: claims resumed, its rows' outcomes can be written again",
                queue,
                extra={"event": "claims_resumed", "queue": queue},
            )

    def report(
        self,
        operation: str,
        exc: DatabaseError,
        logger: logging.Logger,
        extra: dict[str, object] | None = None,
    ) -> bool:
        """Record `exc` if it is permanent, and log it unless that was done in the last minute
        (`extra`: the caller's structured log fields). False for any other error: the caller
        handles it as before."""
        if not isinstance(exc, PermanentError):
            return False
        reason = one_line(exc)
        self._open.pop(operation, None)
        self._open[operation] = reason
        sqlstate = exc.sqlstate
        key = (operation, sqlstate)
        now = time.monotonic()
        if now - self._logged.get(key, -LOG_EVERY) >= LOG_EVERY:
            self._logged[key] = now
            logger.error(
                "%s failed: %s. This does not pass by retrying: grant the privilege or run "
                "`outbox-farm migrate` / `outbox-farm check`. Retrying meanwhile; logged at "
                "most once a minute",
                operation,
                reason,
                extra={
                    "event": "permanent_error",
                    "operation": operation,
                    "sqlstate": sqlstate,
                    **(extra or {}),
                },
            )
        return True

    def solved(self, operation: str) -> None:
        """`operation` succeeded: whatever problem it had is over."""
        if self._open and self._open.pop(operation, None) is not None:
            self._logged = {k: v for k, v in self._logged.items() if k[0] != operation}


class Stall:
    """Whether one queue is stalled, as its fetcher sees it: its claims keep failing, or its
    oldest ready row keeps ageing although this process holds nothing of the queue and its
    claims come back empty (the farm is idle, yet the row is not taken).

    A stall lasts until the queue flows again: a claim that succeeds ends a failing stall; a
    claim that returns rows, or an idle fetch that finds nothing overdue, ends an idle one.
    Written by the fetcher task; `reason` is read by the runtime's `problem`.
    """

    def __init__(self, queue: str, *, failures: int, failing_for: float, overdue: float) -> None:
        self.queue = queue
        self.max_failures = failures
        self.max_failing_for = failing_for
        self.max_overdue = overdue
        self.kind: str | None = None  # "failing" or "idle" while stalled, else None
        self.reason: str | None = None  # why, as one line; None while the queue flows
        self._failures = 0
        self._failing_since = 0.0
        self._idle_overdue = 0  # idle fetches in a row that found a row overdue

    def claim_failed(self, exc: BaseException) -> bool:
        """A claim failed; True when this made the queue stalled."""
        now = time.monotonic()
        if not self._failures:
            self._failing_since = now
        self._failures += 1
        failing_for = now - self._failing_since
        if self._failures < self.max_failures and failing_for < self.max_failing_for:
            return False
        return self._set(
            "failing",
            f"queue {self.queue} stalled: its claims failed {self._failures} times in a row "
            f"over {failing_for:.0f}s: {type(exc).__name__}: {one_line(exc)}",
        )

    def claimed(self, rows: int) -> bool:
        """A claim succeeded with `rows` rows; True when this ended the stall."""
        self._failures = 0
        if rows:
            self._idle_overdue = 0
        if self.kind == "failing" or (self.kind == "idle" and rows):
            return self._set(None, None)
        return False

    def paused(self) -> bool:
        """The operator paused the queue: its rows waiting is no stall, and the count starts
        afresh once it resumes. True when this ended a stall."""
        self._failures = 0
        self._idle_overdue = 0
        return self._set(None, None) if self.kind is not None else False

    def idle(self, overdue: float) -> bool:
        """An idle fetch (nothing held, the claim came back empty) found the oldest ready row
        due `overdue` seconds ago (0 or less: none is due). Two such fetches in a row with a
        row overdue past the threshold stall the queue (one alone may have raced another
        process's claim). True when this started or ended the stall."""
        if overdue <= self.max_overdue:
            self._idle_overdue = 0
            return self._set(None, None) if self.kind == "idle" else False
        self._idle_overdue += 1
        if self._idle_overdue < 2:
            return False
        return self._set(
            "idle",
            f"queue {self.queue} stalled: its oldest ready row has been due for {overdue:.0f}s "
            "while its claims find nothing to take and this worker holds none of its rows",
        )

    def _set(self, kind: str | None, reason: str | None) -> bool:
        """Record the state; True when it changed from stalled to not or back."""
        changed = (kind is None) != (self.kind is None)
        self.kind, self.reason = kind, reason
        return changed
