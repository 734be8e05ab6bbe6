"""The plan of a replay or purge: exactly the rows its dry run showed, or nothing.

A count is no proof of a set. A dry run showed 11 rows; someone replayed one of them; a row
whose transaction was open during the count committed below the bound and took its place: 11
rows matched again, and a run checked by count alone would have acted on a row the operator
never saw. So the dry run reads the ids of the rows it shows (`read_ids`) and the plan names
that set, and the run acts on those ids only, in chunks (`act`):

- up to `PLAN_IDS` rows (every ticked selection, most filters), the ids travel in the signed
  plan itself; rows of the plan gone since (replayed, purged meanwhile) are not there to act
  on, the done page says how many, and no other row can be touched;
- a larger set (a filter matching 100,000 rows) travels as its size and a SHA-256 digest of
  its ids, so the confirmation page stays small: the run reads the set again and refuses when
  it is not the very same (`changed`), then acts on the ids it has just read, so a row that
  commits after that check is not touched either;
- past `MAX_ROWS` rows the dry run is refused: one request of the console holds every id in
  memory, and `outbox-farm dlq replay|purge` (or a narrower filter) suits such a job better.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from ..admin import DlqFilter, Done, When, dlq_list, dlq_purge, dlq_replay
from ..admin.dlq import MAX_ID
from ..db.connect import Connection
from ..errors import ConfigurationError
from ..names import TableNames

PLAN_IDS = 10_000  # rows whose ids the signed plan carries; above, their digest
MAX_ROWS = 200_000  # rows one console action may plan
READ_PAGE = 20_000  # ids read per statement
CHUNK = 1_000  # ids acted on per call, each call one batch, committed


def digest(ids: Sequence[int]) -> str:
    """The SHA-256 of a set of ids, whatever their order."""
    return hashlib.sha256(",".join(map(str, sorted(ids))).encode()).hexdigest()


def read_ids(conn: Connection, names: TableNames, where: DlqFilter, upto: int) -> list[int]:
    """The ids of the rows `where` matches with ids up to `upto`, highest first (the DLQ list's
    keyset, page by page); ConfigurationError past `MAX_ROWS`."""
    found: list[int] = []
    before: int | None = upto + 1 if upto < MAX_ID else None
    while True:
        page = [r.id for r in dlq_list(conn, names, where, READ_PAGE, before=before)]
        found += page
        if len(found) > MAX_ROWS:
            raise ConfigurationError(
                f"this selection holds more than {MAX_ROWS:,} rows, more than one action of "
                "the console takes: narrow the filter (a shorter time range, a queue), or run "
                "`outbox-farm dlq replay` or `outbox-farm dlq purge` with it"
            )
        if len(page) < READ_PAGE:
            return found
        before = page[-1]


def iso(point: When | None) -> str | None:
    """A time of a filter as the plan and the links hold it (None: not given)."""
    return point.at.isoformat() if point is not None and point.at is not None else None


def make(
    action: str, scope: str, everything: bool, where: DlqFilter, upto: int, ids: list[int]
) -> dict[str, Any]:
    """The plan (JSON-able, to be signed) of `action` on the rows `ids` `where` matched."""
    return {
        "action": action,
        "scope": scope,
        "everything": everything,
        "ids": list(where.ids or ()),
        "queue": where.queue,
        "reason": where.reason,
        "since": iso(where.since),
        "until": iso(where.until),
        "grep": where.grep,
        "cause": where.cause,
        "upto": upto,
        "expected": len(ids),
        "rows": sorted(ids) if len(ids) <= PLAN_IDS else None,
        "digest": digest(ids),
    }


def where_of(plan: dict[str, Any]) -> DlqFilter:
    """The selection a plan was made for, times absolute."""

    def point(text: Any) -> When | None:
        return When(at=datetime.fromisoformat(text)) if isinstance(text, str) else None

    return DlqFilter(
        ids=tuple(plan["ids"]) or None,
        queue=plan["queue"],
        reason=plan["reason"],
        since=point(plan["since"]),
        until=point(plan["until"]),
        grep=plan["grep"],
        cause=plan["cause"],
    )


def planned_ids(conn: Connection, names: TableNames, plan: dict[str, Any]) -> list[int] | None:
    """The ids a run of `plan` acts on: those it carries, or (a digest plan) the set read
    again, if it is the very same; None when it is not."""
    if plan["rows"] is not None:
        return [int(i) for i in plan["rows"]]
    now = read_ids(conn, names, where_of(plan), int(plan["upto"]))
    return now if digest(now) == plan["digest"] else None


def act(
    conn: Connection,
    names: TableNames,
    plan: dict[str, Any],
    ids: list[int],
    *,
    to_queue: str | None,
    delay: float,
    progress: Callable[[int], None],
) -> Done:
    """Replay or purge the rows `ids` (those still there, still matching the plan's filter),
    `CHUNK` at a time, each chunk committed before the next."""
    where, upto = where_of(plan), int(plan["upto"])
    rows = batches = notified = 0
    ordered = sorted(ids)
    for start in range(0, len(ordered), CHUNK):
        chunk = dataclasses.replace(where, ids=tuple(ordered[start : start + CHUNK]))
        if plan["action"] == "replay":
            done = dlq_replay(
                conn,
                names,
                chunk,
                to_queue=to_queue,
                delay=delay,
                batch=CHUNK,
                upto=upto,
                progress=progress,
            )
        else:
            done = dlq_purge(conn, names, chunk, batch=CHUNK, upto=upto, progress=progress)
        rows, batches, notified = rows + done.rows, batches + done.batches, notified + done.notified
    return Done(rows, batches, notified)
