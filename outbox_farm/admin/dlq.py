"""The dead-letter table for an operator: find rows, read one, replay them, purge them.

Seed 003 gives the DLQ three uses: inspect and discard (`list`, `show`, `purge`), fix and
replay (`replay`), escalate (the counts in `stats` and the dashboards). Replay and purge work in
batches keyed on id, each batch one statement and one transaction, so an interrupted run has
done whole batches only and running it again finishes the job: nothing is lost and nothing is
moved twice. Both are bounded by the highest id their summary counted (`upto`), so what is done
is what the operator was shown, even while the farm keeps writing new failures.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import orjson
import psycopg

from ..errors import ConfigurationError, DatabaseError
from ..names import TableNames
from .durations import When
from .sql import AdminSql

DEFAULT_BATCH = 1000


@dataclass(frozen=True)
class DlqFilter:
    """Which DLQ rows an operation is about; every field left None matches every row."""

    ids: tuple[int, ...] | None = None
    queue: str | None = None
    reason: str | None = None
    since: When | None = None  # failed at or after
    until: When | None = None  # failed before
    grep: str | None = None

    def params(self) -> dict[str, Any]:
        for what, text in (("queue", self.queue), ("reason", self.reason), ("grep", self.grep)):
            if text is not None and "\x00" in text:
                raise ConfigurationError(f"{what} contains a NUL character, which no row holds")
        since, until = self.since or When(), self.until or When()
        return {
            "ids": list(self.ids) if self.ids is not None else None,
            "queue": self.queue,
            "reason": self.reason,
            "since_at": since.at,
            "since_ago": since.ago,
            "until_at": until.at,
            "until_ago": until.ago,
            "grep": self.grep,
        }


@dataclass(frozen=True)
class DlqRow:
    """One row as `list` shows it: the exception's first line, the payload's size."""

    id: int
    original_id: int
    queue: str
    reason: str
    deliveries_count: int
    created_at: datetime
    failed_at: datetime
    payload_bytes: int
    headers: dict[str, Any]
    exception: str


@dataclass(frozen=True)
class Payload:
    """A payload decoded by its content-type header: `json`, `text`, or `base64` bytes."""

    encoding: str
    value: Any

    @classmethod
    def decode(cls, body: bytes, content_type: str | None) -> Payload:
        kind = (content_type or "").split(";")[0].strip().lower()
        if kind == "application/json" or kind.endswith("+json"):
            try:
                return cls("json", orjson.loads(body))
            except orjson.JSONDecodeError:
                pass  # labelled JSON but is not: show what is there
        if kind.startswith("text/") or kind in ("application/json", ""):
            try:
                return cls("text", body.decode("utf-8"))
            except UnicodeDecodeError:
                pass
        return cls("base64", base64.b64encode(body).decode("ascii"))


@dataclass(frozen=True)
class DlqEntry:
    """One row in full, as `show` prints it."""

    id: int
    original_id: int
    queue: str
    reason: str
    deliveries_count: int
    created_at: datetime
    failed_at: datetime
    payload: Payload
    payload_bytes: int
    headers: dict[str, Any]
    last_exception: str | None
    timer_id: str | None


@dataclass(frozen=True)
class SummaryLine:
    queue: str
    reason: str
    rows: int
    first_failed_at: datetime
    last_failed_at: datetime


@dataclass(frozen=True)
class Summary:
    """What a filter matches now, by queue and reason; `upto` is the highest id among them."""

    lines: list[SummaryLine] = field(default_factory=list)
    upto: int = 0

    @property
    def rows(self) -> int:
        return sum(line.rows for line in self.lines)


@dataclass(frozen=True)
class Done:
    """What a replay or purge did."""

    rows: int
    batches: int
    notified: int = 0  # replay: NOTIFYs sent (one per queue and batch with due rows)


def _sql(names: TableNames) -> AdminSql:
    if names.dlq is None:
        raise ConfigurationError(
            "no DLQ table is configured; leave out --no-dlq (or give --dlq-table)"
        )
    return AdminSql(names)


def _run(conn: psycopg.Connection[Any], statement: str, params: dict[str, Any]) -> list[Any]:
    try:
        return conn.execute(statement, params).fetchall()
    except psycopg.Error as exc:
        raise DatabaseError(f"DLQ statement failed: {str(exc).strip()}") from exc


def dlq_list(
    conn: psycopg.Connection[Any], names: TableNames, where: DlqFilter, limit: int = 50
) -> list[DlqRow]:
    """The newest `limit` rows matching `where`, newest first."""
    statement = _sql(names).render("admin_dlq_list", match="admin_dlq_match")
    rows = _run(conn, statement, where.params() | {"limit": limit})
    return [
        DlqRow(row[0], row[1], row[2], row[3], row[4], row[5], row[6], row[7], row[8] or {}, row[9])
        for row in rows
    ]


def dlq_show(conn: psycopg.Connection[Any], names: TableNames, row_id: int) -> DlqEntry | None:
    """Row `row_id` with its payload decoded by content type; None when there is none."""
    rows = _run(conn, _sql(names).render("admin_dlq_show"), {"id": row_id})
    if not rows:
        return None
    rid, original, queue, reason, deliveries, created, failed, body, headers, exc, timer = rows[0]
    headers = headers or {}
    payload = Payload.decode(bytes(body), headers.get("content-type"))
    return DlqEntry(
        rid,
        original,
        queue,
        reason,
        deliveries,
        created,
        failed,
        payload,
        len(body),
        headers,
        exc,
        timer,
    )


def dlq_summary(conn: psycopg.Connection[Any], names: TableNames, where: DlqFilter) -> Summary:
    """Counts by queue and reason of the rows `where` matches: what a dry run reports."""
    statement = _sql(names).render("admin_dlq_summary", match="admin_dlq_match")
    rows = _run(conn, statement, where.params())
    return Summary(
        [SummaryLine(*row[:5]) for row in rows], max((row[5] for row in rows), default=0)
    )


def _batches(
    conn: psycopg.Connection[Any],
    statement: str,
    params: dict[str, Any],
    progress: Callable[[int], None] | None,
) -> tuple[int, int, int]:
    """Run a keyset-batched statement until it matches nothing: (rows, batches, notifies).

    Each batch is its own transaction (the connection must not be inside one already), so what
    a batch did is committed before the next starts.
    """
    after, rows, batches, notified = 0, 0, 0, 0
    while True:
        try:
            with conn.transaction():
                row = conn.execute(statement, params | {"after": after}).fetchone()
        except psycopg.Error as exc:
            raise DatabaseError(
                f"DLQ batch failed after {rows} row(s) in {batches} batch(es), all committed; "
                f"nothing of the failed batch was changed: {str(exc).strip()}"
            ) from exc
        assert row is not None  # an aggregate: always one row
        if row[0] is None:
            return rows, batches, notified
        after, rows, batches = row[0], rows + row[1], batches + 1
        notified += row[2] if len(row) > 2 else 0
        if progress is not None:
            progress(row[1])


def dlq_replay(
    conn: psycopg.Connection[Any],
    names: TableNames,
    where: DlqFilter,
    *,
    to_queue: str | None = None,
    delay: float = 0.0,
    batch: int = DEFAULT_BATCH,
    upto: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> Done:
    """Move the matching rows back into the outbox (to `to_queue` if given), due in `delay`
    seconds, with fresh counters and `replayed_from` / `replay_count` headers; wakes the farm.

    `upto` bounds the run to ids up to that one (default: the highest id matching now).
    """
    if to_queue is not None and ("\x00" in to_queue or not to_queue):
        raise ConfigurationError("--to-queue must be a non-empty name without NUL characters")
    if upto is None:
        upto = dlq_summary(conn, names, where).upto
    params = where.params() | {
        "upto": upto,
        "batch": batch,
        "to_queue": to_queue,
        "delay": delay,
        "channel": names.channel,
    }
    statement = _sql(names).render("admin_dlq_replay", match="admin_dlq_match")
    return Done(*_batches(conn, statement, params, progress))


def dlq_purge(
    conn: psycopg.Connection[Any],
    names: TableNames,
    where: DlqFilter,
    *,
    batch: int = DEFAULT_BATCH,
    upto: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> Done:
    """Delete the matching rows for good, in batches; `upto` as for `dlq_replay`."""
    if upto is None:
        upto = dlq_summary(conn, names, where).upto
    params = where.params() | {"upto": upto, "batch": batch}
    statement = _sql(names).render("admin_dlq_purge", match="admin_dlq_match")
    return Done(*_batches(conn, statement, params, progress))
