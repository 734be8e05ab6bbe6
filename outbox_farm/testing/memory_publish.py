"""The producer's statements over a `memory.MemoryStore`'s outbox, as `queries/producer.sql`
runs them: a row, a timer kept, moved or cancelled, a batch; each due time refused where the
table would refuse it.

Its own module because publishing is the store's other way in, apart from the runtime's claims
and writes: its rules are the timers' (one live timer per queue and id, a leased one never
moved) and the due times', and it shares only the tables with the rest. Not locked: the store
holds its lock around every call, and sends the NOTIFY a row published due calls for.
"""

from __future__ import annotations

from datetime import UTC, datetime

import orjson

from ..db.publish import Due, NewBatch, NewRow
from .memory_rows import Row, after, check_due
from .memory_table import Tables

FAR_FUTURE = datetime.max.replace(tzinfo=UTC)  # a due time past anything the table admits


def published(tables: Tables, new: NewRow, now: datetime) -> Row | None:
    """`publish`, `publish_timer` or `publish_extend`: a live timer of the same queue and
    id wins under `ignore`; under `extend` it takes the new body, headers and due time,
    unless it is leased (a running handler's ack must not delete a newer timer)."""
    due = _due(new.due, now)
    live = _timer(tables, new.queue, new.timer_id) if new.timer_id is not None else None
    if live is None:
        return tables.add(new, due, now)
    if not new.extend_timer or live.acquired_token is not None:
        return None
    live.payload, live.headers = new.payload, orjson.loads(new.headers)
    live.next_attempt_at = due
    if new.priority:  # an extend without a priority keeps the timer's
        live.priority = new.priority
    return live


def published_batch(tables: Tables, batch: NewBatch, now: datetime) -> tuple[list[Row], datetime]:
    """`publish_batch`: the rows of `batch`, in its order, and the due time they share."""
    keys = batch.ordering_keys or [None] * len(batch.payloads)
    due = _due(batch.due, now)
    rows = [
        tables.add(
            NewRow(
                batch.queue,
                payload,
                headers,
                batch.due,
                ordering_key=key,
                priority=batch.priority,
                fair_key=batch.fair_key,
            ),
            due,
            now,
        )
        for payload, headers, key in zip(batch.payloads, batch.headers, keys, strict=True)
    ]
    return rows, due


def cancelled(tables: Tables, queue: str, timer_id: str) -> bool:
    """`cancel_timer`: whether a pending timer was deleted (not one whose handler runs)."""
    live = _timer(tables, queue, timer_id)
    if live is None or live.acquired_token is not None:
        return False
    del tables.rows[live.id]
    return True


def _due(due: Due, now: datetime) -> datetime:
    """`coalesce(at, now() + delay)`, refused when the table would refuse it."""
    at = due.at.astimezone(UTC) if due.at is not None else after(now, due.delay, FAR_FUTURE)
    return check_due(at)


def _timer(tables: Tables, queue: str, timer_id: str | None) -> Row | None:
    return next(
        (r for r in tables.rows.values() if r.queue == queue and r.timer_id == timer_id),
        None,
    )
