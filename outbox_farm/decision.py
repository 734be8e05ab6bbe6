"""The decision core: what happens to a claimed row, as pure functions over plain data.

In: the queue's policy (`HandlerSpec`: `max_deliveries`, `retry`, `ack`), the row (`Message`:
its counters and the ack/nack/reject its handler recorded), the exception the run ended with,
and when the run started (epoch seconds, database clock) and how long it took. Out: a
`Verdict`, the `Outcome` the completer writes and the `Note`s to log. Nothing here awaits,
logs, counts or reads a clock, so each rule can be pinned down without a database or an event
loop.

This is the one rulebook. Its predicates, whether a claimed row runs (`before_run`), whether a
run that returned acks its row (`completes`) and what an exception means (`raised`), and
`decide`, the verdict after a run built on them, are asked through this module by every path:
the executor's one-row and batch loops (a relay's too), a transactional handler's commit and
the test kit's recorder. None of them restates a rule, so a rule added to the predicate it
refines reaches them all. (The one-row loop acks a row that `completes` acks without calling
`decide`, whose first step that is: a call less per message, the same rule.)

The rules, in order:
- a row the fetcher could not load is terminal (`invalid_row`, or `max_deliveries` past it) unrun;
- a row claimed more than `max_deliveries` times is terminal (`max_deliveries`) unrun;
- a decision the handler recorded (`ack()`, `nack(delay)`, `reject()`) wins over its return or
  exception;
- return: ack, unless the policy is manual (then, undecided, a `NoDecision` failure, retried);
- `DeadLetter`, or any exception under `reject_on_error`: terminal `rejected`;
- `Retry(delay)`: that delay when it is seconds >= 0, else the strategy's;
- anything else: the strategy's delay; None, a raise, NaN, an infinity or a negative from the
  strategy make the failure terminal (`retry_terminal`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from logging import ERROR, WARNING
from typing import Any

from .errors import DeadLetter, Retry
from .handler import AckPolicy, HandlerSpec
from .message import Decision, Message
from .outcome import Kind, Outcome, Reason, describe_exception, exception_line, exception_type


class NoDecision(RuntimeError):
    """A manual-ack handler returned without calling ack(), nack() or reject()."""


class Event(enum.Enum):
    """What a note reports; the value is its log line's `event` field."""

    RETRY = "retry"
    TERMINAL = "terminal"
    NO_DECISION = "no_decision"
    BAD_RETRY_DELAY = "bad_retry_delay"
    STRATEGY_FAILED = "strategy_failed"
    LEASE_LOST = "lease_lost"  # handed back unrun: too little of its lease was left


@dataclass(frozen=True, slots=True)
class Note:
    """One log line about a decision: its level, %-template and arguments, and the structured
    fields it carries besides `event`, `row_id` and `queue`. `error` is the exception it is
    about, for observers that want more than the text."""

    event: Event
    level: int
    text: str
    args: tuple[Any, ...]
    fields: dict[str, Any] | None = None
    error: BaseException | None = None


Notes = tuple[Note, ...]
# The outcome, and what to log about it. A plain tuple: the ack path builds nothing else.
Verdict = tuple[Outcome, Notes]

QUIET: Notes = ()
# Read once: an Enum member read off its class costs 0.1 µs (Python 3.11), and `decide` and
# `completes` run for every row.
_ACK, _MANUAL, _ACKED = Kind.ACK, AckPolicy.MANUAL, Decision.ACK


def before_run(spec: HandlerSpec, msg: Message) -> Verdict | None:
    """The verdict on a row that must not run (one the fetcher could not load, or claimed more
    than `max_deliveries` times), or None: run it."""
    if msg.invalid is not None:
        return _invalid(spec, msg, msg.invalid)
    limit = spec.max_deliveries
    if limit is None or msg.deliveries_count <= limit:
        return None
    outcome = _outcome(msg, Kind.TERMINAL)
    outcome.reason = Reason.MAX_DELIVERIES
    note = Note(
        Event.TERMINAL,
        ERROR,
        "row %s of queue %s was claimed %d times (max_deliveries=%d); giving up without "
        "running the handler",
        (msg.id, msg.queue, msg.deliveries_count, limit),
        {"reason": str(Reason.MAX_DELIVERIES)},
    )
    return outcome, (note,)


def _invalid(spec: HandlerSpec, msg: Message, why: str) -> Verdict:
    """A row whose values cannot be loaded: terminal unrun, `invalid_row` with `why` (which
    value, and what is wrong with it) as its `last_exception`. Past `max_deliveries` it is
    `max_deliveries`, so that limit holds for every row, loadable or not."""
    limit = spec.max_deliveries
    reason = Reason.INVALID_ROW
    if limit is not None and msg.deliveries_count > limit:
        reason = Reason.MAX_DELIVERIES
    outcome = _outcome(msg, Kind.TERMINAL)
    outcome.reason, outcome.last_exception = reason, why
    note = Note(
        Event.TERMINAL,
        ERROR,
        "row %s of queue %s cannot be loaded (%s); giving up without running the handler (%s)",
        (msg.id, msg.queue, why, reason),
        {"reason": str(reason)},
    )
    return outcome, (note,)


def decide(
    spec: HandlerSpec, msg: Message, exc: BaseException | None, started: float, duration: float
) -> Verdict:
    """The verdict on a row whose handler ran from `started` for `duration` seconds and
    returned (`exc` None) or raised `exc`."""
    decision = msg.decision
    if exc is None:
        if completes(spec, msg):  # the common case: `_outcome` written out, one call less
            return Outcome(_ACK, msg.id, msg.lease_token, msg.queue, msg.deliveries_count), QUIET
        if decision is None:
            return _undecided(spec, msg, started, duration)
    elif decision is None:
        return raised(spec, msg, exc, started, duration)
    elif decision is _ACKED:
        return _outcome(msg, _ACK), QUIET
    error = failure(msg, exc)
    if decision is Decision.REJECT:
        return _terminal(msg, Reason.REJECTED, error, QUIET)
    return _retry(spec, msg, error, msg.nack_delay, started, duration, QUIET)


def completes(spec: HandlerSpec, msg: Message) -> bool:
    """Whether a handler that returned (did not raise) acks its row: what `decide` makes of a
    return (and the one-row loop, acking such a row without it), and what a transactional
    handler's transaction asks before it commits."""
    decision = msg.decision
    if decision is None:
        return spec.ack is not _MANUAL
    return decision is _ACKED


def _undecided(spec: HandlerSpec, msg: Message, started: float, duration: float) -> Verdict:
    """A run that returned without completing its row and without a decision recorded: a
    `NoDecision` failure, retried."""
    undecided = NoDecision(
        f"manual-ack handler of queue {msg.queue!r} returned without "
        "ack(), nack() or reject(); retrying"
    )
    note = Note(
        Event.NO_DECISION,
        WARNING,
        "%s (row %s)",
        (undecided, msg.id),
        _about(undecided),
        undecided,
    )
    return _retry(spec, msg, undecided, None, started, duration, (note,))


def interrupted(spec: HandlerSpec, msg: Message, started: float, duration: float) -> Verdict:
    """The verdict on a row whose run a stop cancelled at its deadline: what the handler
    recorded, if anything; else tried again at once (the run counts as an attempt)."""
    if msg.decision is not None:
        return decide(spec, msg, None, started, duration)
    return _retry_outcome(msg, 0.0, started), QUIET


def expired(spec: HandlerSpec, msg: Message) -> Verdict:
    """The verdict on a row that waited for an executor until less than half its lease was
    left: handed back unrun, its delivery taken back; another runner may hold it already."""
    note = Note(
        Event.LEASE_LOST,
        WARNING,
        "lease lost: row %s of queue %s waited for an executor until less than half its lease "
        "was left (lease_ttl=%gs); handing it back unrun (lower prefetch or raise lease_ttl if "
        "this recurs)",
        (msg.id, msg.queue, spec.lease_ttl),
        {"phase": "start", "deliveries_count": msg.deliveries_count},
    )
    return _outcome(msg, Kind.EXPIRE), (note,)


def released(msg: Message) -> Outcome:
    """A row never started because the runtime stops: its lease cleared, its delivery taken
    back, so another process takes it at once."""
    return _outcome(msg, Kind.RELEASE)


def failure(msg: Message, exc: BaseException | None) -> BaseException | None:
    """What a failed row is reported with (DLQ text, retry strategy, log, on_failure hook): the
    error given to its nack()/reject(), else the exception the run ended with."""
    return msg.error if msg.error is not None else exc


def raised(
    spec: HandlerSpec, msg: Message, exc: BaseException, started: float, duration: float
) -> Verdict:
    """The verdict on a run that raised `exc` with no decision recorded: `DeadLetter` is
    terminal, a `Retry` retries (after its own delay when that is seconds >= 0), anything else
    is terminal under `reject_on_error` and retried after the strategy's delay otherwise."""
    if isinstance(exc, DeadLetter):
        return _terminal(msg, Reason.REJECTED, exc, QUIET)
    if isinstance(exc, Retry) and exc.delay is not None:
        delay = _seconds(exc.delay)
        if delay is not None:
            return _retry(spec, msg, exc, delay, started, duration, QUIET)
        note = Note(
            Event.BAD_RETRY_DELAY,
            WARNING,
            "Retry(delay=%r) from the handler of queue %s is not seconds >= 0; using the retry "
            "strategy instead (row %s)",
            (exc.delay, msg.queue, msg.id),
            _about(exc),
            exc,
        )
        return _retry(spec, msg, exc, None, started, duration, (note,))
    if spec.ack is AckPolicy.REJECT_ON_ERROR and not isinstance(exc, Retry):
        return _terminal(msg, Reason.REJECTED, exc, QUIET)
    return _retry(spec, msg, exc, None, started, duration, QUIET)


def _seconds(value: object) -> float | None:
    """A `Retry(delay=...)` as seconds >= 0 (a number or a timedelta), or None when it is not."""
    try:
        delay = float(value.total_seconds() if isinstance(value, timedelta) else value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return delay if math.isfinite(delay) and delay >= 0 else None


def _retry(
    spec: HandlerSpec,
    msg: Message,
    error: BaseException | None,
    delay: float | None,
    started: float,
    duration: float,
    notes: Notes,
) -> Verdict:
    """Retry after `delay`, or after the strategy's delay when None; terminal when the
    strategy gives up or fails."""
    if delay is None:
        delay, trouble = _strategy_delay(spec, msg, error or NoDecision(), started, duration)
        if trouble is not None:
            notes = (*notes, trouble)
        if delay is None:
            return _terminal(msg, Reason.RETRY_TERMINAL, error, notes)
    if error is not None:
        # One line, the exception's type and first line: its frames are for a terminal
        # failure's line (and for DEBUG), not repeated with every attempt.
        attempt, fields = msg.attempts_count + 1, _about(error)
        note = Note(
            Event.RETRY,
            WARNING,
            "handler of queue %s failed on row %s (attempt %d); retrying in %.3gs: %s",
            (msg.queue, msg.id, attempt, delay, fields["error"]),
            {"attempt": attempt, "delay": delay, **fields},
            error,
        )
        notes = (*notes, note)
    return _retry_outcome(msg, delay, started), notes


def _strategy_delay(
    spec: HandlerSpec, msg: Message, exc: BaseException, started: float, duration: float
) -> tuple[float | None, Note | None]:
    """The strategy's delay (None: give up), and a note when the strategy itself failed.

    The attempt is the number of runs so far, this one included; the elapsed time runs from the
    row's first attempt (this one for a first attempt) to the end of this run. A strategy that
    raises, or returns anything but seconds >= 0, must neither crash the worker nor drop the
    row: its failure is terminal, like a None.
    """
    first = msg.first_attempt_at.timestamp() if msg.first_attempt_at is not None else started
    try:
        delay = spec.retry.next_delay(msg.attempts_count + 1, exc, started - first + duration)
        if delay is None:
            return None, None
        seconds = float(delay)
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"next_delay returned {delay!r}; expected seconds >= 0")
    except Exception as strategy_error:
        note = Note(
            Event.STRATEGY_FAILED,
            ERROR,
            "retry strategy %r failed for row %s of queue %s (%r); treating the failure as "
            "terminal",
            (spec.retry, msg.id, msg.queue, strategy_error),
            _about(strategy_error),
            strategy_error,
        )
        return None, note
    return seconds, None


def _about(error: BaseException) -> dict[str, Any]:
    """A note's structured fields on `error`, so that a log pipeline can group failures by
    type without parsing messages."""
    return {"error_type": exception_type(error), "error": exception_line(error)}


def _outcome(msg: Message, kind: Kind) -> Outcome:
    return Outcome(kind, msg.id, msg.lease_token, msg.queue, msg.deliveries_count)


def _retry_outcome(msg: Message, delay: float, started: float) -> Outcome:
    outcome = _outcome(msg, Kind.RETRY)
    outcome.delay, outcome.ran = delay, True
    outcome.started_at = datetime.fromtimestamp(started, UTC)
    return outcome


def _terminal(msg: Message, reason: Reason, error: BaseException | None, notes: Notes) -> Verdict:
    outcome = _outcome(msg, Kind.TERMINAL)
    outcome.reason, outcome.last_exception = reason, describe_exception(error)
    # The one line of a failure that carries its frames (the DLQ's text): the last word on it.
    fields = {"reason": str(reason)} if error is None else {"reason": str(reason), **_about(error)}
    note = Note(
        Event.TERMINAL,
        ERROR,
        "row %s of queue %s failed for good (%s): %s",
        (msg.id, msg.queue, reason, outcome.last_exception),
        fields,
        error,
    )
    return outcome, (*notes, note)
