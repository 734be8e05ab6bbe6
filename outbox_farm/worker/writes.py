"""A batch of outcomes as the writes of one flush: one set-based write per phase (ack, retry,
release, expire, terminal), in that order, each carrying the outcomes of its rows."""

from __future__ import annotations

from dataclasses import dataclass

from .. import storage
from ..outcome import Kind, Outcome

PHASES = (
    ("ack", Kind.ACK),
    ("retry", Kind.RETRY),
    ("release", Kind.RELEASE),
    ("expire", Kind.EXPIRE),
    ("terminal", Kind.TERMINAL),
)


@dataclass(slots=True)
class Statement:
    """One write of a flush, and the outcomes it carries (in the order of its rows)."""

    phase: str
    outcomes: list[Outcome]
    write: storage.Write


def statements(batch: list[Outcome], *, dlq: bool) -> list[Statement]:
    """The writes of `batch`, its phases in order, those without rows left out; `dlq`: the
    store keeps terminal rows (see `write_for`)."""
    # Grouped by identity tests: an Enum member hashes in Python, once per outcome.
    by_kind: dict[Kind, list[Outcome]] = {kind: [] for kind in Kind}
    acks, ack = by_kind[Kind.ACK], Kind.ACK
    for outcome in batch:
        if outcome.kind is ack:
            acks.append(outcome)
        else:
            by_kind[outcome.kind].append(outcome)
    return [
        Statement(phase, rows, write_for(phase, rows, dlq=dlq))
        for phase, kind in PHASES
        if (rows := by_kind[kind])
    ]


def write_for(phase: str, rows: list[Outcome], *, dlq: bool) -> storage.Write:
    """The write of `phase` over `rows`: a rows' lease that ran short (`expire`) is released
    like a row never started, and a terminal row with no DLQ to keep it is deleted."""
    ids = [o.row_id for o in rows]
    tokens = [o.token for o in rows]
    if phase == "retry":
        return storage.retry(
            ids,
            tokens,
            delays=[o.delay for o in rows],
            ran=[o.ran for o in rows],
            started=[o.started_at for o in rows],
        )
    if phase in ("release", "expire"):
        return storage.release(ids, tokens)
    if phase == "terminal" and dlq:
        return storage.dead_letter(
            ids,
            tokens,
            reasons=[str(o.reason) for o in rows],
            exceptions=[o.last_exception for o in rows],
        )
    return storage.ack(ids, tokens)  # an ack, or a terminal failure with no DLQ to keep it
