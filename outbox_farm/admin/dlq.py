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

Rows are grouped by cause (`dlq_causes`): their `last_exception` normalised so that rows that
differ only in ids, numbers or addresses fall together (the rule is migration 0009's). A text
filter that is empty or blank is refused, whichever it is: an empty text is contained in every
row, so `--grep ""` from a script with an unset variable would select the whole DLQ.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

from ..db import dlq as db
from ..db.connect import Connection
from ..db.dlq import CauseGroup as CauseGroup  # re-exported: the API names it here
from ..db.dlq import DlqFacts, DlqMatch, DlqRow, Done, Summary
from ..db.operator import DlqReader, UnfitRow
from ..errors import ConfigurationError
from ..names import TableNames
from ..outcome import Reason
from .durations import When
from .payload import Payload as Payload  # re-exported: `show` callers import it from here

DEFAULT_BATCH = 1000
UNFIT_SHOWN = 20  # rows a replay names one by one among those it normalises
COUNT_CAP = 10_000  # rows `dlq_count` counts one by one before it estimates
MAX_ID = 2**63 - 1  # ids are bigint
MAX_QUEUE = 255  # characters: the outbox's queue column is varchar(255)
REASONS = tuple(reason.value for reason in Reason)
SETTLE = 3.0  # seconds a preview waits for writers that were running when it counted
CAUSES_SHOWN = 20  # groups `dlq_causes` returns unless told


def check_reason(reason: str | None) -> None:
    """Refuse a failure reason the farm never writes (a typo would match nothing)."""
    if reason is not None and reason not in REASONS:
        raise ConfigurationError(f"reason {reason!r} is not one of {', '.join(REASONS)}")


def check_id(row_id: int) -> int:
    """`row_id` if it can be a DLQ id (1 to 2^63-1); ConfigurationError otherwise."""
    if not 1 <= row_id <= MAX_ID:
        raise ConfigurationError(f"{row_id} is not a row id (ids are 1 to {MAX_ID})")
    return row_id


@dataclass(frozen=True)
class DlqFilter:
    """Which DLQ rows an operation is about; every field left None matches every row."""

    ids: tuple[int, ...] | None = None
    queue: str | None = None
    reason: str | None = None
    since: When | None = None  # failed at or after
    until: When | None = None  # failed before
    grep: str | None = None
    cause: str | None = None  # a cause exactly as a `CauseGroup` names it

    def check(self) -> None:
        """Refuse (ConfigurationError) a text filter that is empty or blank, or holds a NUL
        character (which no row can hold): before any SQL, the same way for every one."""
        texts = (
            ("queue", self.queue),
            ("reason", self.reason),
            ("grep", self.grep),
            ("cause", self.cause),
        )
        for what, text in texts:
            if text is None:
                continue
            if not text.strip():
                raise ConfigurationError(
                    f"the {what} filter is empty: give a value, or leave the filter out "
                    "(an empty text would select every row, or none)"
                )
            if "\x00" in text:
                raise ConfigurationError(f"{what} contains a NUL character, which no row holds")

    def match(self) -> DlqMatch:
        """The filter as the statements take it, checked (`check`)."""
        self.check()
        for row_id in self.ids or ():
            check_id(row_id)
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
            cause=self.cause,
        )


@dataclass(frozen=True)
class Selection:
    """What a replay or purge acts on: rows by id, the rows a filter matches, or every row,
    and never every row by accident. Made by `Selection.of`, the one rule for the CLI and the
    console."""

    where: DlqFilter
    everything: bool  # no id and no filter: every row of the DLQ, asked for as such

    @classmethod
    def of(
        cls,
        ids: Sequence[int],
        where: DlqFilter,
        every: bool,
        *,
        verb: str,
        filtered: bool | None = None,
        every_is: str = "every row",
        filters_are: str = "queue, reason, since, until, text, cause",
        asked_in: str = "",
    ) -> Selection:
        """IDs (narrowed by `where`), a filter, or `every` row. Refused (ConfigurationError,
        worded for `verb`, and with `every_is` and `filters_are` naming how the caller asks
        for them, e.g. "--all", and `asked_in` where, e.g. " on the command line"): IDs and
        `every` together; none of the three; an id out of range; an unknown reason; an empty
        filter (`DlqFilter.check`). `filtered` says whether the operator chose the filter (the
        CLI passes False for one read from the environment only: it narrows, never selects);
        None: whether `where` filters anything."""
        ids = tuple(check_id(int(i)) for i in ids)
        where.check()
        check_reason(where.reason)
        if ids and every:
            raise ConfigurationError(
                f"give IDs or {every_is}, not both: {every_is} would {verb} every row"
            )
        chosen = filtered if filtered is not None else where != DlqFilter()
        if not (ids or every or chosen):
            raise ConfigurationError(
                f"say which rows to {verb}{asked_in}: IDs, a filter ({filters_are}) or {every_is}"
            )
        where = dataclasses.replace(where, ids=tuple(sorted(set(ids))) if ids else None)
        return cls(where, every and not ids and where == DlqFilter())


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


def dlq_show(
    conn: Connection, names: TableNames, row_id: int, *, payload_cap: int | None = None
) -> DlqEntry | None:
    """Row `row_id` with its payload decoded by content type; None when there is none. With
    `payload_cap`, only that many bytes of the payload are read and decoded (`payload_bytes`
    is still the whole size: more than the cap means the payload shown is cut)."""
    _need_dlq(names)
    row = db.read_row(conn, names, check_id(row_id), payload_cap)
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
        row.payload_bytes,
        row.headers,
        row.last_exception,
        row.timer_id,
    )


def dlq_causes(
    conn: Connection, names: TableNames, where: DlqFilter, limit: int = CAUSES_SHOWN
) -> list[CauseGroup]:
    """The `limit` causes with the most rows matching `where`, most rows first (ties by
    cause). A group's `cause` given back as `DlqFilter(cause=...)` selects its rows, for a
    list, a replay or a purge. Milliseconds on any DLQ size when `where` filters at most by
    queue, reason and cause (the counts migration 0009 keeps); a time, text or id filter
    costs the rows it matches. SchemaError when the DLQ predates migration 0009."""
    _need_dlq(names)
    check_reason(where.reason)
    return db.causes(conn, names, where.match(), limit)


def dlq_payload(conn: Connection, names: TableNames, row_id: int) -> bytes | None:
    """Row `row_id`'s payload, whole, as stored; None when there is no such row."""
    _need_dlq(names)
    return db.read_payload(conn, names, check_id(row_id))


def dlq_summary(
    conn: Connection, names: TableNames, where: DlqFilter, *, upto: int | None = None
) -> Summary:
    """Counts by queue and reason of the rows `where` matches (with ids up to `upto`, None:
    any): what a dry run reports."""
    _need_dlq(names)
    return db.summarize(conn, names, where.match(), upto)


def dlq_resolved(conn: Connection, names: TableNames, where: DlqFilter) -> DlqFilter:
    """`where` with `since` and `until` given as durations ago turned into times, on the
    database's clock: a plan previewed now and run in a minute acts on the same window."""
    if all(point is None or point.ago is None for point in (where.since, where.until)):
        return where
    _need_dlq(names)
    now = db.now(conn, names)

    def fixed(point: When | None) -> When | None:
        if point is None or point.ago is None:
            return point
        return When(at=now - timedelta(seconds=point.ago))

    return dataclasses.replace(where, since=fixed(where.since), until=fixed(where.until))


@dataclass(frozen=True)
class Preview:
    """A dry run whose count stays true: `summary` counts every row with an id up to
    `summary.upto` that matches, and no row can join them later (`settled`), or that could
    not be made sure of within the wait (a transaction open since before the count)."""

    summary: Summary
    settled: bool


def dlq_preview(
    conn: Connection, names: TableNames, where: DlqFilter, *, settle: float = SETTLE
) -> Preview:
    """What a replay or purge bounded by the returned `upto` would touch, counted so that the
    set cannot grow afterwards.

    `max(id)` alone is no boundary: a transaction that took a lower id may commit after the
    count. So, after a first count, this waits (up to `settle` seconds) until every
    transaction running at that count has ended, then counts again within its `upto`: every
    row with a lower id is committed or never will be, so the second count is the set. A
    writer that took its id before the first count but its transaction id only after it
    (the id's default evaluated, the row not yet inserted) escapes the wait; the caller's
    recount at run time (`dlq_summary(upto=...)`, refused when higher) catches that too.
    """
    _need_dlq(names)
    first = dlq_summary(conn, names, where)
    if not first.rows:
        return Preview(first, True)
    xmax = db.snapshot_xmax(conn, names)
    deadline = time.monotonic() + settle
    settled = db.horizon_passed(conn, names, xmax)
    while not settled and time.monotonic() < deadline:
        time.sleep(0.02)
        settled = db.horizon_passed(conn, names, xmax)
    return Preview(dlq_summary(conn, names, where, upto=first.upto), settled)


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
    match = where.match()
    rows, first = DlqReader(conn, names).unfit(asdict(match), match.block, upto, limit)
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
    if to_queue is not None and ("\x00" in to_queue or not to_queue or len(to_queue) > MAX_QUEUE):
        raise ConfigurationError(
            f"--to-queue must be a non-empty name of at most {MAX_QUEUE} characters, without "
            "NUL characters"
        )
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
