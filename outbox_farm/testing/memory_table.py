"""The tables of a `memory.MemoryStore`: its outbox rows and DLQ rows, and the outcome writes
(`ack`, `retry`, `release`, `dlq_move`, and the hand-over `ack_next`) applied to them as the
statements of `queries/runtime.sql` apply them, row by row."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter, defaultdict
from collections.abc import Callable
from datetime import datetime
from typing import Any

import orjson

from ..db.publish import NewRow
from ..message import Message
from ..storage import Claim, Write, Written
from .memory_rows import LONGEST_RETRY, RETRY_UNTIL, DeadLetter, Row, after

Heads = dict[tuple[str, str], int]
"""The id of the oldest row left of each queue and ordering key."""


class Tables:
    """The rows of one store. Not locked: its store holds its lock around every call."""

    def __init__(self, dlq: bool) -> None:
        self.dlq = dlq
        self.rows: dict[int, Row] = {}  # by id, which is also the order they were added in
        self.dead: list[DeadLetter] = []
        self._ids = itertools.count(1)
        self._dead_ids = itertools.count(1)

    def add(self, new: NewRow, due: datetime, now: datetime) -> Row:
        """Insert a row of `new`, due at `due` (the publish statements' INSERT)."""
        row = Row(
            next(self._ids),
            new.queue,
            new.payload,
            orjson.loads(new.headers),
            created_at=now,
            next_attempt_at=due,
            timer_id=new.timer_id,
            ordering_key=new.ordering_key,
            priority=new.priority,
            fair_key=new.fair_key,
        )
        self.rows[row.id] = row
        return row

    def heads(self) -> Heads:
        """Where each key's line starts: a claim takes no other row of the key."""
        heads: Heads = {}
        for row in self.rows.values():  # in id order: the first seen is the oldest
            if row.ordering_key is not None:
                heads.setdefault((row.queue, row.ordering_key), row.id)
        return heads

    def write(
        self, write: Write, handover: Claim | None, now: datetime
    ) -> tuple[Written, list[str]]:
        """`write`, its rows matched by id and token (`Written.matched` by position), and with
        an ack the hand-over claim `handover` of the next row of each key it deleted a row of;
        and the queues whose fetchers that wakes (see `_woken`)."""
        apply = {
            "ack": self._ack,
            "retry": self._retry,
            "release": self._release,
            "dlq_move": self._dlq_move,
        }[write.kind]
        matched: set[int] = set()
        gone: list[Row] = []
        for n, (row_id, token) in enumerate(zip(write.ids, write.tokens, strict=True)):
            row = self.rows.get(row_id)
            if row is None or row.acquired_token != token:
                continue  # held under another token, or gone: not written
            matched.add(n)
            if apply(row, {name: values[n] for name, values in write.columns.items()}, now):
                gone.append(row)
        claimed = self._hand_over(handover, gone, now) if handover is not None else []
        return Written(matched, claimed=claimed), _woken(gone, handover, len(claimed))

    def _ack(self, row: Row, columns: dict[str, Any], now: datetime) -> bool:
        """Delete the row."""
        del self.rows[row.id]
        return True

    def _retry(self, row: Row, columns: dict[str, Any], now: datetime) -> bool:
        """Free the lease; due `delays` seconds from now (at most `LONGEST_RETRY`, and never
        past `RETRY_UNTIL`); a run (`ran`) counts an attempt and is dated `started`, the
        first one kept."""
        row.next_attempt_at = after(now, min(columns["delays"], LONGEST_RETRY), RETRY_UNTIL)
        if columns["ran"]:
            row.attempts_count += 1
            if row.first_attempt_at is None:
                row.first_attempt_at = columns["started"]
            row.last_attempt_at = columns["started"]
        row.free()
        return False

    def _release(self, row: Row, columns: dict[str, Any], now: datetime) -> bool:
        """Free the lease and take back the delivery its claim counted."""
        row.free()
        row.deliveries_count = max(row.deliveries_count - 1, 0)
        return False

    def _dlq_move(self, row: Row, columns: dict[str, Any], now: datetime) -> bool:
        """Archive the row with `reasons` and `exceptions`, and delete it, in one step."""
        if not self.dlq:
            raise ValueError("this store has no DLQ: a terminal row is deleted with an ack")
        self.dead.append(
            DeadLetter(
                id=next(self._dead_ids),
                original_id=row.id,
                queue=row.queue,
                payload=row.payload,
                headers=row.headers,
                deliveries_count=row.deliveries_count,
                created_at=row.created_at,
                failed_at=now,
                failure_reason=columns["reasons"],
                last_exception=columns["exceptions"],
                timer_id=row.timer_id,
            )
        )
        del self.rows[row.id]
        return True

    def _hand_over(self, claim: Claim, gone: list[Row], now: datetime) -> list[Message]:
        """`ack_next`'s claim: for each key of `claim.queue` the ack deleted a row of, the
        oldest row of the key left, leased under `claim.token` if it is free and due."""
        keys = dict.fromkeys(
            row.ordering_key
            for row in gone
            if row.queue == claim.queue and row.ordering_key is not None
        )
        heads = self.heads()
        taken = []
        for key in keys:
            head = self.rows.get(heads.get((claim.queue, key), 0))
            if head is not None and head.acquired_token is None and head.next_attempt_at <= now:
                taken.append(head.take(claim, now))
        return taken


def _woken(gone: list[Row], handover: Claim | None, taken: int) -> list[str]:
    """The queues whose fetchers a deletion wakes (Postgres's NOTIFY at commit): those of the
    keyed rows it deleted, each of which may have freed the next row of its key; but not the
    hand-over's queue when the hand-over took the next row of every such key."""
    keys: dict[str, set[str]] = defaultdict(set)
    for row in gone:
        if row.ordering_key is not None:
            keys[row.queue].add(row.ordering_key)
    return [
        queue
        for queue, freed in keys.items()
        if handover is None or queue != handover.queue or len(freed) > taken
    ]


def first_of_key(row: Row, heads: Heads) -> bool:
    """Whether no older row of its key is left (always, for a row without a key)."""
    key = row.ordering_key
    return key is None or heads[(row.queue, key)] == row.id


def pending(row: Row, heads: Heads) -> bool:
    """Free, and first of its key: a claim takes it once it is due."""
    return row.acquired_token is None and first_of_key(row, heads)


def due_order(row: Row) -> tuple[Any, ...]:
    """The plain due order: soonest due first, then oldest."""
    return (row.next_attempt_at, row.id)


def rank_order(row: Row) -> tuple[Any, ...]:
    """The order of the claim's ranked rows (priority above 0): highest first, then in due
    order."""
    return (-row.priority, row.next_attempt_at, row.id)


def ranked_limit(limit: int, draw: Callable[[], float] = random.random) -> int:
    """How many rows of a claim of `limit` may be taken by priority: all but a quarter,
    rounded at random (`claim`'s `limit - floor(limit / 4 + random())`), so a 4-row claim
    keeps exactly one row for the plain due order and a 1-row claim one time in four."""
    return limit - math.floor(limit / 4 + draw())


def claim_order(due: list[Row], limit: int, draw: Callable[[], float] = random.random) -> list[Row]:
    """The claimable due rows `due` (in `due_order`) in the order a claim of `limit` takes them
    after the expired leases: up to `ranked_limit` rows of priority above 0, highest first, then
    the rest in plain due order whatever their priority (Postgres's `ranked`, then `pending`).
    Without a row above 0 that is `due` as it is."""
    if not any(row.priority > 0 for row in due):
        return due
    ranked = sorted((row for row in due if row.priority > 0), key=rank_order)
    ranked = ranked[: max(ranked_limit(limit, draw), 0)]
    taken = {row.id for row in ranked}
    return ranked + [row for row in due if row.id not in taken]


def fair_order(due: list[Row], leased: Counter[str | None], key_max: int) -> list[Row]:
    """The claimable due rows `due` (in `due_order`) a fair claim takes after the expired
    leases (Postgres's `claim_fair`): of each fair key, rows without one counting as one key of
    their own, its oldest up to `key_max` less its `leased` rows; taken round the keys, every
    key's first row, then every key's second, each round in due order. Priorities do not
    order them. Unlike Postgres, which looks for rows without a fair key only among the
    queue's first due rows, every such row is found here."""
    ranks: Counter[str | None] = Counter()
    chosen: list[tuple[int, tuple[Any, ...], Row]] = []
    for row in due:
        key = row.fair_key
        if ranks[key] + leased[key] >= key_max:
            continue
        ranks[key] += 1
        chosen.append((ranks[key], due_order(row), row))
    chosen.sort(key=lambda taken: taken[:2])
    return [row for _, _, row in chosen]
