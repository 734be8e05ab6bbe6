"""The log observer: the events an operator reads, as structured log lines.

Each line keeps the logger of the component that saw the event (`outbox_farm.executor` for
decisions, `outbox_farm.completer` for writes, `outbox_farm.inflight` for the heartbeat's
findings, `outbox_farm.fetcher` for stalls), so logging configurations that filter by logger
keep working.

A failing queue retries every row it holds, so retry notes repeat: each is one line (the
exception's type and first line, the row, the attempt, the delay), and above DEBUG at most
`BURST` of one kind (queue, event, cause) pass every `WINDOW` seconds, the others counted in one
`lines_suppressed` line (see `repeats`). At DEBUG every one passes, with the innermost frames of
its exception. A terminal failure's line always passes, with its frames: it is the last word on
its row.
"""

from __future__ import annotations

import logging
from logging import DEBUG

from ..decision import Event, Note, Notes
from ..message import Message
from ..outcome import Outcome, innermost_frames
from .base import Observer
from .repeats import Kind, RepeatLimit

decisions = logging.getLogger("outbox_farm.executor")
writes = logging.getLogger("outbox_farm.completer")
heartbeat = logging.getLogger("outbox_farm.inflight")
claims = logging.getLogger("outbox_farm.fetcher")

BURST = 5
WINDOW = 60.0
# What comes with every retry of a failing queue, row after row.
_REPEATING = frozenset({Event.RETRY, Event.NO_DECISION, Event.BAD_RETRY_DELAY})


class LogObserver(Observer):
    def __init__(self, burst: int = BURST, window: float = WINDOW) -> None:
        self._repeats = RepeatLimit(burst, window, self._held_back)

    def noted(self, msg: Message, notes: Notes) -> None:
        for note in notes:
            text, args = note.text, note.args
            if note.event in _REPEATING:
                if not decisions.isEnabledFor(DEBUG):
                    if not self._repeats.admit(msg.queue, note.event.value, _cause(note)):
                        continue
                elif note.error is not None:
                    text, args = text + "%s", (*args, innermost_frames(note.error))
            extra = {"event": note.event.value, "row_id": msg.id, "queue": msg.queue}
            if note.fields:
                extra.update(note.fields)
            decisions.log(note.level, text, *args, extra=extra)

    def _held_back(self, kind: Kind, count: int, seconds: float) -> None:
        queue, event, cause = kind
        limit = self._repeats
        decisions.warning(
            "%d similar %s lines of queue %s suppressed in the last %.3gs: %s (at most %d of one "
            "cause are logged every %gs; at DEBUG, every one)",
            count,
            event,
            queue,
            seconds,
            cause,
            limit.burst,
            limit.window,
            extra={
                "event": "lines_suppressed",
                "queue": queue,
                "suppressed": count,
                "suppressed_event": event,
                "cause": cause,
                "seconds": round(seconds, 3),
            },
        )

    def stopped(self) -> None:
        self._repeats.close()

    def lease_lost(self, phase: str, queue: str, row_id: int, deliveries: int | None) -> None:
        fields = {"event": "lease_lost", "phase": phase, "row_id": row_id, "queue": queue}
        if phase == "heartbeat":
            heartbeat.warning(
                "lease lost: row %s of queue %s is no longer held by this worker while its "
                "handler runs; its outcome will not be written",
                row_id,
                queue,
                extra=fields,
            )
            return
        writes.warning(
            "lease lost: row %s of queue %s was taken over before its %s was written; "
            "nothing was changed (is the heartbeat off, or was the worker stalled?)",
            row_id,
            queue,
            phase,
            extra=fields | {"deliveries_count": deliveries},
        )

    def outcome_unconfirmed(self, phase: str, outcome: Outcome) -> None:
        writes.warning(
            "outcome unconfirmed: the %s of row %s of queue %s was sent again after a lost "
            "connection and found the row already gone or free; the first attempt most likely "
            "wrote it",
            phase,
            outcome.row_id,
            outcome.queue,
            extra={
                "event": "outcome_unconfirmed",
                "phase": phase,
                "row_id": outcome.row_id,
                "queue": outcome.queue,
                "deliveries_count": outcome.deliveries_count,
            },
        )

    def stalled(self, queue: str, reason: str | None) -> None:
        if reason is None:
            claims.info(
                "queue %s flows again", queue, extra={"event": "stall_ended", "queue": queue}
            )
        else:
            claims.error("%s", reason, extra={"event": "stalled", "queue": queue})


def _cause(note: Note) -> str:
    """What makes two notes of one event alike: their error's line (type and first line of its
    message), or the note's template for one without."""
    return note.fields.get("error", note.text) if note.fields else note.text
