"""The claims: a queue's due rows taken under a fresh lease (`claim`, or with an ack, the
hand-over `ack_next`), and each row of their results made the `Message` its handler receives,
in one place, by column name."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from weakref import WeakKeyDictionary

import orjson
from psycopg import AsyncConnection, AsyncCursor, postgres
from psycopg.adapt import Loader
from psycopg.pq import Format
from psycopg.rows import AsyncRowFactory

from ..message import Message
from ..queries import Queries, compose, load_blocks
from ..storage import Claim

CLAIMED_COLUMNS = (
    "id",
    "payload",
    "headers",
    "deliveries_count",
    "attempts_count",
    "created_at",  # NULL when `unloadable` says it cannot be loaded
    "next_attempt_at",  # idem
    "first_attempt_at",
    "timer_id",
    "acquired_at",  # the claim's now(): the same for every row of one claim
    "ordering_key",
    "unloadable",  # which values of the row cannot be loaded, and why; NULL: none
)
"""The columns a claim returns, each row its lease just taken, found by name in its result
(`message_maker`), so a reordered `runtime.sql` still works and a missing column is refused
at the first claim.

Any row the table admits loads: the statement hands back NULL for a timestamp the client cannot
represent, and the headers are loaded by `HeadersLoader`, which never fails, so a value another
writer stored fails its own row (`Message.invalid` set, for the fetcher to dead-letter) and
never the claim, whose leases would otherwise stay orphaned and its good rows undelivered."""

SET_ASIDE_TOKEN = uuid.UUID(int=0)
"""The lease token of a row set aside (`set_aside`): no runner ever takes the nil uuid, and it
is outside every worker's token range, so only the row's lease expiry frees it."""

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
    `Undecodable` the row carries to be dead-lettered alone. Registered for the claims' cursors
    only (`claim_cursor`): on the farm's own connections, whose binary results are the
    claims' alone."""

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


JSONB_OID = postgres.types["jsonb"].oid
R = TypeVar("R")


def claim_cursor(conn: AsyncConnection[Any], row_factory: AsyncRowFactory[R]) -> AsyncCursor[R]:
    """A cursor of `conn` for a claim's rows: its headers loaded by `HeadersLoader`. The
    farm's own pool has it on every connection already (`pool.open_pool`): registering it on
    each claim's cursor took a claim of one row about 10 µs of the event loop. Any other
    connection (a pool a user passed) gets it on the cursor alone."""
    cursor = conn.cursor(row_factory=row_factory)
    if conn.adapters.get_loader(JSONB_OID, Format.BINARY) is not HeadersLoader:
        cursor.adapters.register_loader(JSONB_OID, HeadersLoader)
    return cursor


_CLAIMED_NAMES = tuple(name.encode() for name in CLAIMED_COLUMNS)
_new = object.__new__

MessageMaker = Callable[[Sequence[Any]], Message]


def message_maker(names: Sequence[str], claim: Claim, received: float) -> MessageMaker:
    """What turns each row of a result of `claim` (its columns named `names`, the
    `CLAIMED_COLUMNS` among them in any order) into its `Message`; `received` (monotonic): when
    the result arrived.

    Every claimed row is built here, by setting its slots: the dataclass's keyword `__init__`
    costs five times as much (a microsecond a row, a tenth of the farm's own time per message).
    `tests/unit/test_message.py` holds the two equal. A row that cannot be loaded still becomes
    a message, `invalid` saying why, with the claim's time standing in for its unloadable
    timestamps and no headers: the fetcher dead-letters it unrun (or sets it aside)."""
    positions: list[int] | None = None
    if tuple(names) != CLAIMED_COLUMNS:
        missing = set(CLAIMED_COLUMNS) - set(names)
        if missing:
            raise RuntimeError(f"the claim statement does not return {sorted(missing)}")
        positions = [list(names).index(name) for name in CLAIMED_COLUMNS]
    queue, token, start_by = claim.queue, claim.token, claim.start_by
    claimed_epoch: float | None = None

    def make(values: Sequence[Any]) -> Message:
        nonlocal claimed_epoch
        if positions is not None:
            values = [values[i] for i in positions]
        (
            row_id,
            payload,
            headers,
            deliveries,
            attempts,
            created,
            due,
            first,
            timer,
            claimed_at,
            key,
            unloadable,
        ) = values
        if claimed_epoch is None:  # one statement: one now() for every row
            claimed_epoch = claimed_at.timestamp()
        msg = _new(Message)
        if unloadable is None and headers.__class__ is not Undecodable:
            msg.invalid = None
        else:
            msg.invalid, headers = _unloadable(unloadable, headers)
            created = created or claimed_at
            due = due or claimed_at
        msg.id = row_id
        msg.queue = queue
        msg.body = payload
        msg.headers = headers or {}
        msg.deliveries_count = deliveries
        msg.attempts_count = attempts
        msg.created_at = created
        msg.next_attempt_at = due
        msg.first_attempt_at = first
        msg.timer_id = timer
        msg.lease_token = token
        msg.claimed_at = claimed_at
        msg.ordering_key = key
        msg.decision = None
        msg.nack_delay = None
        msg.error = None
        msg.received_monotonic = received
        msg.start_by = start_by
        msg.claimed_epoch = claimed_epoch
        msg.due_epoch = due.timestamp()
        return msg

    return make


def _unloadable(unloadable: str | None, headers: Any) -> tuple[str, dict[str, Any] | None]:
    """Why a row cannot be loaded, its unloadable values worded as reasons (headers that are
    not an object, an `Undecodable`, among them), and the headers it can keep."""
    reasons = [_reason(value) for value in unloadable.split("; ")] if unloadable else []
    if isinstance(headers, Undecodable):
        reasons.append(headers.why)
        headers = None
    return "; ".join(reasons), headers


def _reason(value: str) -> str:
    """`created_at: infinity is not a finite timestamp`, from the claim's `created_at=infinity`."""
    field, _, stored = value.partition("=")
    if stored in ("infinity", "-infinity"):
        return f"{field}: {stored} is not a finite timestamp"
    return f"{field}: {stored} is outside the years 1 to 9999"


def _names(cursor: AsyncCursor[Any]) -> tuple[str, ...]:
    """The result's column names, read off the result itself: `cursor.description` builds a
    column object, type lookups included, for each column of every claim, which took a tenth
    of a one-row claim's time in the client."""
    result = cursor.pgresult
    if result is None:
        return ()
    names = tuple(result.fname(i) for i in range(result.nfields))
    if names == _CLAIMED_NAMES:
        return CLAIMED_COLUMNS
    return tuple((name or b"").decode() for name in names)


# The fragments of `claim` that rank rows by `priority` (migration 0013).
RANKING = ("claim_ranked", "claim_after_ranked", "claim_ranked_union")
# The fragments of `claim` that sweep expired leases and far rows (see `Claim.sweep`).
SWEEP = ("claim_sweep", "claim_swept", "claim_swept_far")
RECHECK = 30.0  # seconds a table found without `priority` is claimed from without it
RANK_RECHECK = 1.0  # seconds a queue found with (or without) rows above 0 is claimed so


def claim_text(queries: Queries, *, ranked: bool, sweep: bool) -> str:
    """`claim` with or without its ranking fragments and its sweep."""
    text = load_blocks()["claim"]
    for fragment in (() if ranked else RANKING) + (() if sweep else SWEEP):
        text = text.replace("{" + fragment + "}", "")
    return compose(text, queries.names)


def unranked(queries: Queries) -> str:
    """`claim` without its ranking fragments: the claim of the release before migration 0013,
    for a table without `priority` and for a queue with no row above 0."""
    return claim_text(queries, ranked=False, sweep=True)


class _Claims:
    """The claim statements of one outbox table, and what this process last found: whether
    the table has `priority` (None: not asked yet; False: asked again after `until`), and for
    each queue whether it had rows above 0, and until when (monotonic) that holds."""

    def __init__(self, queries: Queries) -> None:
        self.texts = {
            (ranked, sweep): claim_text(queries, ranked=ranked, sweep=sweep)
            for ranked in (False, True)
            for sweep in (False, True)
        }
        self.schema = queries["claim_schema"]
        self.probe = queries["claim_ranks"]
        self.args = {"table": queries.names.outbox.identifier().as_string(None)}
        self.column: bool | None = None
        self.until = 0.0
        self.queues: dict[str, tuple[bool, float]] = {}


_claims: WeakKeyDictionary[Queries, _Claims] = WeakKeyDictionary()


async def claim_statement(
    conn: AsyncConnection[Any], queries: Queries, queue: str, *, sweep: bool = True
) -> str:
    """The text of `claim` for a claim of `queue`: ranked by priority only while the queue
    has rows above 0, and with the sweep of expired leases and far rows when `sweep`.

    The ranking costs a claim a fifth more planning (every claim is planned afresh: its LIMIT
    and queue are parameters no generic plan weighs well), about 7% of a 50-row claim with no
    priority in use; the issue's bar is none measurable. So the claim of a queue with no row
    above 0 is the claim of the release before, and whether it has any is asked (one probe of
    the small priority index, `claim_ranks`) on its first claim in this process and again
    once `RANK_RECHECK` has passed: a queue's first rows above 0 are ranked within a second,
    and a queue whose last one went is claimed the cheaper way within a second.

    Before that, whether the table has the column at all (migration 0013), asked of the
    catalog on the table's first claim and again every `RECHECK` seconds while it has none: a
    farm started before `outbox-farm migrate` claims as the release before did instead of
    failing every claim. Once found, the column is not asked for again (migrations only add).
    """
    found = _claims.get(queries)
    if found is None:
        found = _claims[queries] = _Claims(queries)
    now = time.monotonic()
    if not found.column and (found.column is None or found.until < now):
        row = await (await conn.execute(found.schema, found.args)).fetchone()
        if row is None:  # no table: the claim fails as it always did, saying to migrate
            return found.texts[False, sweep]
        found.column, found.until = bool(row[0]), now + RECHECK
    if not found.column:
        return found.texts[False, sweep]
    known = found.queues.get(queue)
    if known is None or known[1] < now:
        row = await (await conn.execute(found.probe, {"queue": queue})).fetchone()
        known = found.queues[queue] = (bool(row and row[0]), now + RANK_RECHECK)
    return found.texts[known[0], sweep]


def claim_params(claim: Claim) -> tuple[str, dict[str, Any]]:
    """The statement of `claim` and its arguments: `claim`, or a hand-over's `ack_next`."""
    params: dict[str, Any] = {
        "queue": claim.queue,
        "lease_ttl": claim.lease_ttl,
        "token": claim.token,
    }
    if claim.limit is None:
        return "ack_next", params
    params.update(limit=claim.limit, held=claim.held)
    return "claim", params


async def send_claim(
    conn: AsyncConnection[Any], queries: Queries, claim: Claim
) -> AsyncCursor[Message]:
    """Run `claim` (not a hand-over) on `conn`; its cursor's rows are the messages it took."""

    def messages(cursor: AsyncCursor[Any]) -> MessageMaker:
        return message_maker(_names(cursor), claim, time.monotonic())

    statement, params = claim_params(claim)
    text = queries[statement]
    if statement == "claim":
        text = await claim_statement(conn, queries, claim.queue, sweep=claim.sweep)
    cursor = claim_cursor(conn, messages)
    await cursor.execute(text, params, binary=True)
    return cursor


Handed = tuple[Any, Message | None]
"""A row of `ack_next`: the positions the ack matched (on the first row; None when none), and
the message of the row it took beside it (None when it took none)."""


async def send_handover(
    conn: AsyncConnection[Any], queries: Queries, claim: Claim, ack: dict[str, Any]
) -> AsyncCursor[Handed]:
    """Run the ack with the arguments `ack` as the hand-over `claim` (`ack_next`) on `conn` (in
    pipeline mode, only queue it); its cursor's rows are `Handed`."""

    def handed(cursor: AsyncCursor[Any]) -> Callable[[Sequence[Any]], Handed]:
        names = _names(cursor)[1:]
        make = message_maker(names, claim, time.monotonic())
        taken = names.index("id") + 1

        def row(values: Sequence[Any]) -> Handed:
            return values[0], make(values[1:]) if values[taken] is not None else None

        return row

    cursor = claim_cursor(conn, handed)
    statement, params = claim_params(claim)
    await cursor.execute(queries[statement], {**ack, **params}, binary=True)
    return cursor


FAIR_LOOKAHEAD = 4
"""How many claims' worth of the queue's first due rows the fair claim looks among for rows
without a fair key (see `claim_fair`): a walk bounded whatever the tenants' backlog."""


async def send_fair_claim(
    conn: AsyncConnection[Any], queries: Queries, claim: Claim, key_max: int
) -> AsyncCursor[Message]:
    """The fair claim on `conn`, inside the caller's transaction: `claim_fair` locks and lists
    the rows, at most `key_max` of each fair key leased at once, and `claim_ids` leases them;
    the cursor's rows are the messages taken. Only for a table that has had migration 0014
    (the per-key limit cannot be set for one that has not: `admin_queue_key_limit`)."""

    def messages(cursor: AsyncCursor[Any]) -> MessageMaker:
        return message_maker(_names(cursor), claim, time.monotonic())

    _, params = claim_params(claim)
    params.update(
        key_max=key_max,
        lookahead=max(claim.limit or 1, 1) * FAIR_LOOKAHEAD,
        aside=SET_ASIDE_TOKEN,
    )
    listed = await (await conn.execute(queries["claim_fair"], params)).fetchall()
    ids = [row[0] for row in listed]
    taking = {"ids": ids, "keyed": any(row[1] for row in listed), **params}
    cursor = claim_cursor(conn, messages)
    await cursor.execute(queries["claim_ids"], taking, binary=True)
    return cursor
