"""The fetcher's statements: claim a queue's due rows under a fresh lease, ask when the queue
next has something to claim, and set aside a row that can be neither loaded nor dead-lettered."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
from psycopg import AsyncConnection, AsyncCursor
from psycopg.adapt import Loader
from psycopg.pq import Format

from ..queries import Queries
from .boundary import boundary
from .pool import Pool

ClaimedRow = tuple[
    int,  # id
    bytes,  # payload
    dict[str, Any] | None,  # headers
    int,  # deliveries_count
    int,  # attempts_count
    datetime | None,  # created_at: None when `unloadable` says it cannot be loaded
    datetime | None,  # next_attempt_at: idem
    datetime | None,  # first_attempt_at
    str | None,  # timer_id
    datetime,  # acquired_at: the claim's now(), the same for every row of one claim
    str | None,  # ordering_key
    str | None,  # unloadable: which values of the row cannot be loaded, and why; None: none
]
"""One row as the claim returned it, its lease just taken, in the order of `CLAIMED_COLUMNS`.

A plain tuple rather than a named one: the fetcher turns each row into a `Message` at once, and
psycopg builds plain tuples on its fast path (a row factory costs about a microsecond a row,
a few percent of the whole per-message cost). The order is guaranteed by column name here, so a
reordered `runtime.sql` still works and a missing column is refused at the first claim.

Any row the table admits loads: the statement hands back NULL for a timestamp the client cannot
represent, and the headers are loaded by `HeadersLoader`, which never fails, so a value another
writer stored fails its own row (`unloadable` set, for the fetcher to dead-letter) and never the
claim, whose leases would otherwise stay orphaned and its good rows undelivered."""

CLAIMED_COLUMNS = (
    "id",
    "payload",
    "headers",
    "deliveries_count",
    "attempts_count",
    "created_at",
    "next_attempt_at",
    "first_attempt_at",
    "timer_id",
    "acquired_at",
    "ordering_key",
    "unloadable",
)
HEADERS = CLAIMED_COLUMNS.index("headers")
UNLOADABLE = CLAIMED_COLUMNS.index("unloadable")

SET_ASIDE_TOKEN = uuid.UUID(int=0)
"""The lease token of a row set aside (`set_aside`): no runner ever takes the nil uuid, and it
is outside every worker's token range, so only the row's lease expiry frees it."""
SET_ASIDE_SECONDS = 3600.0
"""How long a row stays set aside before it is claimed (and reported) again: often enough that
the warning is not forgotten, seldom enough not to flood the log."""

_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}
_JSON_TYPES[type(None)] = "null"


def decode_headers(text: str | None) -> tuple[dict[str, Any] | None, str | None]:
    """The headers stored as JSON text, and None; or None and why they cannot be decoded.

    orjson first (fast, and what the producer wrote with); the standard library where orjson
    refuses a document Postgres accepts (an integer beyond 64 bits). A document nested deeper
    than Python's recursion allows fails its row alone.
    """
    if text is None:
        return None, None
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as exc:
            return None, f"headers: cannot be decoded ({type(exc).__name__}: {exc})"
    if not isinstance(value, dict):
        return None, f"headers: a JSON {_JSON_TYPES.get(type(value), 'value')}, not an object"
    return value, None


class Undecodable(str):
    """Headers the claim could not take as an object: the stored JSON text, with `why`."""

    why: str


def _undecodable(text: str, why: str) -> Undecodable:
    found = Undecodable(text)
    found.why = why
    return found


class HeadersLoader(Loader):
    """The claim's headers, loaded without ever failing the fetch: a JSON object becomes a dict
    (orjson, one call per row, as psycopg's own jsonb loader would make), anything else an
    `Undecodable` the row carries to be dead-lettered alone. Registered on the claim's cursor
    only."""

    format = Format.BINARY

    def load(self, data: Any) -> Any:
        try:
            value = orjson.loads(data[1:])  # jsonb's binary form: a version byte, then text
        except orjson.JSONDecodeError:
            value = None
        if type(value) is dict:
            return value
        text = bytes(data[1:]).decode("utf-8", "replace")
        headers, why = decode_headers(text)
        return headers if headers is not None else _undecodable(text, why or "")


_CLAIMED_NAMES = tuple(name.encode() for name in CLAIMED_COLUMNS)


def _in_order(cursor: AsyncCursor[Any], rows: list[Any], skip: int = 0) -> list[Any]:
    """`rows` in the order of `CLAIMED_COLUMNS`, whatever order the statement returned, its
    first `skip` columns left out.

    The names are read off the result itself: `cursor.description` builds a column object,
    type lookups included, for each of the twelve columns of every claim, which took a tenth
    of a one-row claim's time in the client."""
    result = cursor.pgresult
    if (
        result is not None
        and tuple(result.fname(i) for i in range(skip, result.nfields)) == _CLAIMED_NAMES
    ):
        return [row[skip:] for row in rows] if skip else rows
    names = tuple(column.name for column in cursor.description or ())[skip:]
    missing = set(CLAIMED_COLUMNS) - set(names)
    if missing:
        raise RuntimeError(f"the claim statement does not return {sorted(missing)}")
    positions = [names.index(name) + skip for name in CLAIMED_COLUMNS]
    return [tuple(row[i] for i in positions) for row in rows]


def _loaded(row: Any) -> ClaimedRow:
    """`row` with its unloadable values worded as reasons, and headers that are not an object
    (`Undecodable`) replaced by None, their reason joining the others. Called only for such
    rows: any other row is used as psycopg returned it."""
    headers, unloadable = row[HEADERS], row[UNLOADABLE]
    reasons = [_reason(value) for value in unloadable.split("; ")] if unloadable else []
    if isinstance(headers, Undecodable):
        reasons.append(headers.why)
        headers = None
    return (*row[:HEADERS], headers, *row[HEADERS + 1 : UNLOADABLE], "; ".join(reasons))


def _reason(value: str) -> str:
    """`created_at: infinity is not a finite timestamp`, from the claim's `created_at=infinity`."""
    field, _, stored = value.partition("=")
    if stored in ("infinity", "-infinity"):
        return f"{field}: {stored} is not a finite timestamp"
    return f"{field}: {stored} is outside the years 1 to 9999"


@dataclass(slots=True)
class Request:
    """A claim as its fetcher made it: the statement (`claim`, or the hand-over `ack_next`), its
    arguments, its lease token, and when it was made (monotonic), which the lease's deadline is
    counted from."""

    statement: str
    params: dict[str, Any]
    token: uuid.UUID
    sent: float


def claim_request(
    *,
    queue: str,
    limit: int,
    lease_ttl: float,
    token: uuid.UUID,
    held: list[uuid.UUID],
    far: bool = True,
    sent: float = 0.0,
) -> Request:
    """A claim of up to `limit` claimable rows of `queue` (expired leases first, then due rows)
    under `token`, for `lease_ttl` seconds on the database clock, counting a delivery on each.
    Rows claimed under a token in `held` are never taken, even when their lease ran out. `far`:
    look for rows due beyond what a client can load as well (see the statement). `sent`: when
    it was made (monotonic)."""
    params = {
        "queue": queue,
        "limit": limit,
        "lease_ttl": lease_ttl,
        "token": token,
        "held": held,
        "far": far,
    }
    return Request("claim", params, token, sent)


def next_request(*, queue: str, lease_ttl: float, token: uuid.UUID, sent: float) -> Request:
    """A hand-over's request: the next row of each key of `queue` an ack deletes a row of,
    taken by that ack (`ack_next`, see `outcomes.Flush.send`)."""
    params = {"queue": queue, "lease_ttl": lease_ttl, "token": token}
    return Request("ack_next", params, token, sent)


async def send_claim(
    conn: AsyncConnection[Any],
    queries: Queries,
    request: Request,
    more: dict[str, Any] | None = None,
) -> AsyncCursor[Any]:
    """Run a claiming statement on `conn` (in pipeline mode, only queue it), with the
    arguments `more` besides its own; the rows are read by `claimed_rows` (`handed_over`)."""
    cursor = conn.cursor()
    cursor.adapters.register_loader("jsonb", HeadersLoader)
    params = request.params if more is None else {**more, **request.params}
    await cursor.execute(queries[request.statement], params, binary=True)
    return cursor


async def claimed_rows(cursor: AsyncCursor[Any]) -> list[ClaimedRow]:
    """The rows a claim sent by `send_claim` took, each loadable (see `ClaimedRow`)."""
    return _loadable(_in_order(cursor, await cursor.fetchall()))


def handed_over(cursor: AsyncCursor[Any], rows: list[Any]) -> list[ClaimedRow]:
    """The rows an `ack_next` took (sent by `send_claim`): each row of its result past the
    first column (the positions acked), none when those columns are NULL."""
    return _loadable([row for row in _in_order(cursor, rows, skip=1) if row[0] is not None])


def _loadable(rows: list[Any]) -> list[ClaimedRow]:
    """Claimed rows in the order of `CLAIMED_COLUMNS`, each made loadable (see `ClaimedRow`)."""
    return [
        row
        if row[UNLOADABLE] is None and not isinstance(row[HEADERS], Undecodable)
        else _loaded(row)
        for row in rows
    ]


async def take(pool: Pool, queries: Queries, request: Request) -> list[ClaimedRow]:
    """Send the claim `request` on a pooled connection; the rows it took."""
    with boundary():
        async with pool.connection() as conn:
            return await claimed_rows(await send_claim(conn, queries, request))


async def next_due(pool: Pool, queries: Queries, queue: str) -> float | None:
    """Seconds (database clock) until `queue` has a pending row due or a lease expiring;
    negative when one is already due; None when the queue holds no rows."""
    with boundary():
        async with pool.connection() as conn:
            cursor = await conn.execute(queries["next_due"], {"queue": queue})
            row = await cursor.fetchone()
    return None if row is None or row[0] is None else float(row[0])


async def free_stranded(pool: Pool, queries: Queries, queue: str) -> int:
    """Unmark the rows of `queue` left marked `key_blocked` at the head of their key (see the
    statement); how many. Rare, so it is looked for every few seconds, not on every claim."""
    with boundary():
        async with pool.connection() as conn:
            cursor = await conn.execute(queries["free_stranded"], {"queue": queue})
            row = await cursor.fetchone()
    return 0 if row is None else int(row[0])


async def set_aside(
    pool: Pool,
    queries: Queries,
    *,
    ids: list[int],
    token: uuid.UUID,
    seconds: float = SET_ASIDE_SECONDS,
) -> list[int]:
    """Park the rows `ids`, claimed under `token`, under `SET_ASIDE_TOKEN` for `seconds`: rows
    the farm can neither load nor dead-letter. The ids written; the others were lost to a newer
    lease."""
    params = {"ids": ids, "token": token, "aside": SET_ASIDE_TOKEN, "seconds": seconds}
    with boundary():
        async with pool.connection() as conn:
            cursor = await conn.execute(queries["set_aside"], params)
            return [row[0] for row in await cursor.fetchall()]
