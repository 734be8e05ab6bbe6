"""The completer's accounting reads a write's answer row by row: each row written, lost to
another lease, unconfirmed after a resend, refused, or handed back when its lease ran short is
told to the observers as that, and a retry written tells its queue when it comes due."""

from __future__ import annotations

import logging
import uuid

import pytest

from outbox_farm.errors import DatabaseError
from outbox_farm.observe import Observer
from outbox_farm.outcome import Kind, Outcome, Reason
from outbox_farm.problems import Problems
from outbox_farm.storage import Written
from outbox_farm.testing.memory import MemoryStore
from outbox_farm.worker.completer.accounting import Accounting
from outbox_farm.worker.writes import statements


class Seen(Observer):
    def __init__(self) -> None:
        self.events: list[tuple[object, ...]] = []

    def written(self, phase: str, queue: str, rows: int) -> None:
        self.events.append(("written", phase, queue, rows))

    def lease_lost(self, phase: str, queue: str, row_id: int, deliveries: int | None) -> None:
        self.events.append(("lease_lost", phase, queue, row_id))

    def outcome_unconfirmed(self, phase: str, outcome: Outcome) -> None:
        self.events.append(("unconfirmed", phase, outcome.row_id))

    def dead_lettered(self, outcome: Outcome) -> None:
        self.events.append(("dead_lettered", outcome.row_id))

    def write_failed(self, kind: str, queue: str, rows: int) -> None:
        self.events.append(("write_failed", kind, queue, rows))


def accounting(*, dlq: bool = True) -> tuple[Accounting, Seen, list[tuple[str, float]]]:
    seen, due = Seen(), []
    book = Accounting(MemoryStore(dlq=dlq), seen, Problems(), lambda q, d: due.append((q, d)))
    return book, seen, due


def outcome(
    kind: Kind, row_id: int, queue: str = "q", *, delay: float = 0.0, reason: Reason | None = None
) -> Outcome:
    return Outcome(kind, row_id, uuid.uuid4(), queue, 1, delay=delay, reason=reason)


def test_each_row_of_a_retry_is_told_as_what_became_of_it() -> None:
    book, seen, due = accounting()
    rows = [outcome(Kind.RETRY, n, delay=float(n)) for n in (1, 2, 3)]
    [stmt] = statements(rows, dlq=True)
    book.account(stmt, Written(matched={0}, unconfirmed={2}))
    assert due == [("q", 1.0)]
    assert seen.events == [
        ("lease_lost", "retry", "q", 2),
        ("unconfirmed", "retry", 3),
        ("written", "retry", "q", 1),
    ]


def test_a_whole_ack_is_counted_by_queue_and_an_expire_lost_is_not_a_lost_lease() -> None:
    book, seen, due = accounting()
    acks = [outcome(Kind.ACK, 1, "a"), outcome(Kind.ACK, 2, "b"), outcome(Kind.ACK, 3, "a")]
    expired = [outcome(Kind.EXPIRE, 4)]
    ack, expire = statements(acks + expired, dlq=True)
    book.account(ack, Written(matched={0, 1, 2}))
    book.account(expire, Written(matched=set()))
    assert seen.events == [("written", "ack", "a", 2), ("written", "ack", "b", 1)]
    assert due == []


def test_a_terminal_row_moved_is_dead_lettered_only_with_a_dlq() -> None:
    for dlq, told in ((True, [("dead_lettered", 1)]), (False, [])):
        book, seen, _ = accounting(dlq=dlq)
        [stmt] = statements([outcome(Kind.TERMINAL, 1, reason=Reason.MAX_DELIVERIES)], dlq=dlq)
        book.account(stmt, Written(matched={0}))
        assert seen.events == [*told, ("written", "terminal", "q", 1)]


def test_a_refused_row_counts_as_a_failed_write_and_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="outbox_farm.completer")
    book, seen, _ = accounting()
    [stmt] = statements([outcome(Kind.ACK, 1), outcome(Kind.ACK, 2)], dlq=True)
    book.account(stmt, Written(matched={1}, refused={0: DatabaseError("no room")}))
    assert seen.events == [("write_failed", "ack", "q", 1), ("written", "ack", "q", 1)]
    assert [
        (r.name, getattr(r, "event", None), getattr(r, "row_id", None)) for r in caplog.records
    ] == [("outbox_farm.completer", "write_failed", 1)]


def test_outcomes_given_up_are_counted_by_kind_and_queue() -> None:
    book, seen, _ = accounting()
    book.given_up(
        [outcome(Kind.ACK, 1, "a"), outcome(Kind.ACK, 2, "a"), outcome(Kind.RETRY, 3, "b")]
    )
    assert seen.events == [("write_failed", "ack", "a", 2), ("write_failed", "retry", "b", 1)]
