"""The dead-letter table for an operator: find rows, read one, replay them, purge them.

Seed 003 gives the DLQ three uses: inspect and discard (`list`, `show`, `purge`), fix and
replay (`replay`), escalate (the counts in `stats` and the dashboards). Replay and purge work in
batches keyed on id, each batch one statement and one transaction, so an interrupted run has
done whole batches only and running it again finishes the job: nothing is lost and nothing is
moved twice. Both are bounded by the highest id their summary counted (`upto`), so what is done
is what the operator was shown, even while the farm keeps writing new failures.

A DLQ row may hold a value the outbox's values check (migration 0006) refuses: an `invalid_row`
dead-lettered with a `created_at` of ±infinity, or headers that are a JSON array. Copied as it
is, one such row would fail its whole batch, and so the replay, every time. Replay normalises it
(`created_at` becomes the replay's time, headers that are not an object are kept under
`original_headers`, and the header `replay_normalised` says what changed): the message is
handled again rather than left behind, and its handler sees what was done to it. Leaving it in
the DLQ would leave the operator nothing to do but purge it: there is no command to edit a row.
`dlq_unfit` names those rows beforehand.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from ..db import dlq as db
from ..db.connect import Connection
from ..db.dlq import DlqFacts, DlqMatch, DlqRow, Done, Summary
from ..db.operator import DlqReader, UnfitRow
from ..errors import ConfigurationError
from ..names import TableNames
from .durations import When

DEFAULT_BATCH = 1000
UNFIT_SHOWN = 20  # rows a replay names one by one among those it normalises
COUNT_CAP = 10_000  # rows `dlq_count` counts one by one before it estimates


@dataclass(frozen=True)
class DlqFilter:
    """Which DLQ rows an operation is about; every field left None matches every row."""

    ids: tuple[int, ...] | None = None
    queue: str | None = None
    reason: str | None = None
    since: When | None = None  # failed at or after
    until: When | None = None  # failed before
    grep: str | None = None

    def match(self) -> DlqMatch:
        """The filter as the statements take it; a NUL character, which no row can hold, is
        refused here, before any SQL."""
        for what, text in (("queue", self.queue), ("reason", self.reason), ("grep", self.grep)):
            if text is not None and "\x00" in text:
                raise ConfigurationError(f"{what} contains a NUL character, which no row holds")
        since, until = self.since or When(), self.until or When()
        return DlqMatch(
            ids=list(self.ids) if self.ids is not None else None,
            queue=self.queue,
            reason=self.reason,
            since_at=since.at,
            since_ago=since.ago,
            until_at=until.at,
            until_ago=until.ago,
            grep=self.grep,
        )


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
class DlqEntry(DlqFacts):
    """One row in full, as `show` prints it."""

    payload: Payload
    payload_bytes: int
    headers: dict[str, Any]
    last_exception: str | None
    timer_id: str | None


def _need_dlq(names: TableNames) -> None:
    if names.dlq is None:
        raise ConfigurationError(
            "no DLQ table is configured; leave out --no-dlq (or give --dlq-table)"
        )


def dlq_list(
    conn: Connection,
    names: TableNames,
    where: DlqFilter,
    limit: int = 50,
    *,
    before: int | None = None,
) -> list[DlqRow]:
    """The newest `limit` rows matching `where`, newest first; `before` (an id) starts the
    page after the one that ended with it (keyset pagination: every page costs the same)."""
    _need_dlq(names)
    return db.list_rows(conn, names, where.match(), limit, before)


def dlq_count(
    conn: Connection, names: TableNames, where: DlqFilter, cap: int = COUNT_CAP
) -> tuple[int, bool]:
    """How many rows `where` matches: exact (True) up to `cap`, above it the planner's
    estimate (False). A full count of a DLQ of millions of rows takes seconds; a page that
    says "of about 1,200,000" is as useful and answers at once."""
    _need_dlq(names)
    return db.count_rows(conn, names, where.match(), cap)


def dlq_show(conn: Connection, names: TableNames, row_id: int) -> DlqEntry | None:
    """Row `row_id` with its payload decoded by content type; None when there is none."""
    _need_dlq(names)
    row = db.read_row(conn, names, row_id)
    if row is None:
        return None
    return DlqEntry(
        row.id,
        row.original_id,
        row.queue,
        row.reason,
        row.deliveries_count,
        row.created_at,
        row.failed_at,
        Payload.decode(row.payload, row.headers.get("content-type")),
        len(row.payload),
        row.headers,
        row.last_exception,
        row.timer_id,
    )


def dlq_summary(conn: Connection, names: TableNames, where: DlqFilter) -> Summary:
    """Counts by queue and reason of the rows `where` matches: what a dry run reports."""
    _need_dlq(names)
    return db.summarize(conn, names, where.match())


@dataclass(frozen=True)
class Unfit:
    """The rows a replay will normalise: how many, and the first few by id."""

    rows: int = 0
    first: list[UnfitRow] = field(default_factory=list)


def dlq_unfit(
    conn: Connection,
    names: TableNames,
    where: DlqFilter,
    *,
    upto: int,
    limit: int = UNFIT_SHOWN,
) -> Unfit:
    """Which rows matching `where`, with ids up to `upto`, `dlq_replay` will normalise, and
    what it changes in each."""
    _need_dlq(names)
    rows, first = DlqReader(conn, names).unfit(asdict(where.match()), upto, limit)
    return Unfit(rows, first)


def dlq_replay(
    conn: Connection,
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
    A value the outbox refuses is normalised (see the module's docstring, and `dlq_unfit`).

    `upto` bounds the run to ids up to that one (default: the highest id matching now).
    """
    if to_queue is not None and ("\x00" in to_queue or not to_queue):
        raise ConfigurationError("--to-queue must be a non-empty name without NUL characters")
    _need_dlq(names)
    if upto is None:
        upto = dlq_summary(conn, names, where).upto
    return db.replay(
        conn,
        names,
        where.match(),
        upto=upto,
        batch=batch,
        to_queue=to_queue,
        delay=delay,
        progress=progress,
    )


def dlq_purge(
    conn: Connection,
    names: TableNames,
    where: DlqFilter,
    *,
    batch: int = DEFAULT_BATCH,
    upto: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> Done:
    """Delete the matching rows for good, in batches; `upto` as for `dlq_replay`."""
    _need_dlq(names)
    if upto is None:
        upto = dlq_summary(conn, names, where).upto
    return db.purge(conn, names, where.match(), upto=upto, batch=batch, progress=progress)
