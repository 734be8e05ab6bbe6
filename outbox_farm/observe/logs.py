"""The log observer: the events an operator reads, as structured log lines.

Each line keeps the logger of the component that saw the event (`outbox_farm.executor` for
decisions, `outbox_farm.completer` for writes, `outbox_farm.inflight` for the heartbeat's
findings, `outbox_farm.fetcher` for stalls), so logging configurations that filter by logger
keep working.
"""

from __future__ import annotations

import logging

from ..decision import Notes
from ..message import Message
from ..outcome import Outcome
from .base import Observer

decisions = logging.getLogger("outbox_farm.executor")
writes = logging.getLogger("outbox_farm.completer")
heartbeat = logging.getLogger("outbox_farm.inflight")
claims = logging.getLogger("outbox_farm.fetcher")


class LogObserver(Observer):
    def noted(self, msg: Message, notes: Notes) -> None:
        for note in notes:
            extra = {"event": note.event.value, "row_id": msg.id, "queue": msg.queue}
            if note.fields:
                extra.update(note.fields)
            decisions.log(note.level, note.text, *note.args, extra=extra)

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
