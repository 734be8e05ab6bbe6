"""The operator tools' reads: the composition of `queries/admin.sql`, the capped counts and
plans behind `stats`, and the probes of `doctor`. The DLQ's statements are in `db.dlq`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Literal

import psycopg
from psycopg import sql

from ..names import QualifiedName, TableNames
from ..queries import Queries, load_blocks
from .boundary import translate
from .claims import SET_ASIDE_TOKEN
from .connect import Connection

STATS_FAILED = "stats query failed"
# `doctor`'s claim probe: a few rows are enough to run every part of the statement (triggers,
# privileges, the constraints its UPDATE checks); the lease length only decides which legacy
# leases count as expired, and nothing it writes is kept.
PROBE_LIMIT = 10
PROBE_LEASE_TTL = 60.0
PROBE_LOCK_TIMEOUT = "1s"
PROBE_STATEMENT_TIMEOUT = "5s"

OutboxFigure = Literal["ready", "scheduled", "waiting", "in_flight", "expired", "retrying"]
# Each figure of `stats`, in the order it is shown, and the admin_is_* condition it counts.
OUTBOX_CONDITIONS: dict[OutboxFigure, str] = {
    "ready": "admin_is_ready",
    "scheduled": "admin_is_scheduled",
    "waiting": "admin_is_waiting",
    "in_flight": "admin_is_leased",
    "expired": "admin_is_expired",
    "retrying": "admin_is_retrying",
}


class AdminSql:
    """Statements for one pair of tables, each rendered to text once and kept.

    Like `queries.Queries`, but a placeholder may also be filled with another named block (the
    DLQ filter, a count's condition) or with one of the tables, so a filter is written once
    and shared by list, summary, replay and purge instead of being copied into each. A
    placeholder that is itself a block's name is always filled with that block (a fragment
    two statements share whatever parts their caller gives). Nothing is composed other than
    through `psycopg.sql`; every value stays a parameter.
    """

    def __init__(self, names: TableNames) -> None:
        self.names = names
        self._identifiers = names.identifiers()
        self._rendered: dict[tuple[str, tuple[tuple[str, str], ...]], str] = {}

    def table(self, which: str) -> sql.Composable:
        """The identifier of `outbox` or `dlq` (KeyError when no DLQ table is configured)."""
        return self._identifiers[which]

    def render(self, block: str, **parts: str) -> str:
        """Block `block` with each `{part}` filled by the block of that name, itself filled from
        the same parts (`table=` names a table, `outbox` or `dlq`, instead of a block)."""
        key = (block, tuple(sorted(parts.items())))
        if key not in self._rendered:
            self._rendered[key] = self._compose(block, parts).as_string(None)
        return self._rendered[key]

    def _compose(self, block: str, parts: dict[str, str]) -> sql.Composed:
        blocks = load_blocks()
        text = blocks[block]
        fill: dict[str, sql.Composable] = dict(self._identifiers)
        for name in blocks:
            if "{" + name + "}" in text:
                fill[name] = self._compose(name, parts)
        for name, value in parts.items():
            if "{" + name + "}" not in text:
                continue
            if name == "table":
                fill[name] = self.table(value)
            else:
                rest = {k: v for k, v in parts.items() if k != name}
                fill[name] = self._compose(value, rest)
        return sql.SQL(text).format(**fill)


@dataclass(frozen=True)
class Plan:
    """The planner's view of a capped count: its total cost, and the rows it expects the scan
    under the LIMIT to return (the estimate shown when a count is not run or not exact)."""

    cost: float
    rows: int

    @classmethod
    def parse(cls, explained: Any) -> Plan:
        """From EXPLAIN (FORMAT JSON): the top node's cost, the rows of the node under Limit."""
        top = explained[0]["Plan"]
        node = top
        while node.get("Node Type") != "Limit" and node.get("Plans"):
            node = node["Plans"][0]
        scanned = node["Plans"][0] if node.get("Plans") else node
        return cls(float(top["Total Cost"]), int(scanned["Plan Rows"]))


@dataclass(frozen=True)
class DeadCounts:
    """DLQ rows of one queue and reason among the newest read: failed in the last hour, day,
    and all read; `oldest_age` is how long ago the oldest row read (of any reason) failed."""

    reason: str
    last_hour: int
    last_day: int
    total: int
    oldest_age: float


@dataclass(frozen=True)
class StallFacts:
    """What a stall is judged on, for one queue."""

    oldest_due: float  # seconds since its oldest claimable row became due; 0 when none is
    leased: bool  # some row of it is under a live lease (not expired, not set aside)


class _Reader:
    """Reads over one connection, every error translated for the operation `doing` (None:
    the driver's text alone)."""

    def __init__(self, conn: Connection, names: TableNames, doing: str | None) -> None:
        self._conn, self._names, self._doing = conn, names, doing
        self._sql = AdminSql(names)

    def _rows(self, statement: str, params: dict[str, Any] | None = None) -> list[Any]:
        try:
            return self._conn.execute(statement, params).fetchall()
        except psycopg.Error as exc:
            raise translate(exc, doing=self._doing, names=self._names) from exc

    def _first(self, statement: str, params: dict[str, Any] | None = None) -> Any:
        """The one row of an aggregate or settings read."""
        (row,) = self._rows(statement, params)
        return row

    def _queues(self, block: str) -> list[str]:
        return [str(queue) for (queue,) in self._rows(self._sql.render(block))]

    def _oldest_ready(self, queue: str) -> float:
        (age,) = self._first(self._sql.render("admin_oldest_ready"), {"queue": queue})
        return float(age)

    def stall(self, queue: str) -> StallFacts:
        """How long `queue`'s oldest claimable row has waited, and whether anyone holds a live
        lease on a row of it: two index probes, cheap enough for every `stats` frame."""
        params = {"queue": queue, "aside": SET_ASIDE_TOKEN}
        oldest, leased = self._first(self._sql.render("admin_stall"), params)
        return StallFacts(float(oldest), bool(leased))


class StatsReader(_Reader):
    """The reads of `stats`; each error is a `DatabaseError` ("stats query failed"), a missing
    table a `SchemaError` naming it."""

    def __init__(self, conn: Connection, names: TableNames) -> None:
        super().__init__(conn, names, STATS_FAILED)

    def queues(self) -> list[str]:
        """Every queue with rows in the outbox or (when configured) the DLQ, sorted."""
        found = set(self._queues("outbox_queues"))
        if self._names.dlq is not None:
            found.update(self._queues("dlq_queues"))
        return sorted(found)

    def _explain(self, table: str, condition: str, params: dict[str, Any]) -> Plan:
        statement = self._sql.render(
            "admin_explain", statement="admin_count", table=table, condition=condition
        )
        (explained,) = self._first(statement, params)
        return Plan.parse(explained)

    def plan_outbox(self, figure: OutboxFigure, queue: str, cap: int) -> Plan:
        """How the planner sees counting at most `cap` rows of `figure` in `queue`."""
        return self._explain("outbox", OUTBOX_CONDITIONS[figure], {"queue": queue, "cap": cap})

    def count_outbox(self, figure: OutboxFigure, queue: str, cap: int) -> int:
        """The rows of `figure` in `queue`, counted up to `cap`."""
        statement = self._sql.render(
            "admin_count", table="outbox", condition=OUTBOX_CONDITIONS[figure]
        )
        (counted,) = self._first(statement, {"queue": queue, "cap": cap})
        return int(counted)

    def plan_dead(self, queue: str, reason: str, window: float | None, cap: int) -> Plan:
        """How the planner sees counting the DLQ rows of `queue` and `reason` that failed in
        the last `window` seconds (None: ever); only ever planned, never run."""
        params = {"queue": queue, "reason": reason, "window": window, "cap": cap}
        return self._explain("dlq", "admin_is_dead", params)

    def newest_dead(self, queue: str, cap: int) -> list[DeadCounts]:
        """The newest `cap` DLQ rows of `queue`, counted by reason and window."""
        rows = self._rows(self._sql.render("admin_dlq_newest"), {"queue": queue, "cap": cap})
        return [DeadCounts(str(r), int(h), int(d), int(t), float(o)) for r, h, d, t, o in rows]

    def oldest_ready(self, queue: str) -> float:
        """Seconds since the oldest ready row of `queue` became due; 0 when none is."""
        return self._oldest_ready(queue)


@dataclass(frozen=True)
class UnfitRow:
    """A DLQ row the outbox's values check refuses as it is; `what` says what a replay changes
    (the note it leaves in the row's `replay_normalised` header)."""

    id: int
    what: str


class DlqReader(_Reader):
    """The DLQ's reads beside those of `db.dlq`; each error a `DatabaseError`."""

    def __init__(self, conn: Connection, names: TableNames) -> None:
        super().__init__(conn, names, "DLQ statement failed")

    def unfit(
        self, match: dict[str, Any], block: str, upto: int, limit: int
    ) -> tuple[int, list[UnfitRow]]:
        """How many rows matching `match` (the fields of a `DlqMatch`, and its `block`) with
        ids up to `upto` a replay would normalise, and the first `limit` of them by id."""
        statement = self._sql.render("admin_dlq_unfit_rows", match=block)
        rows = self._rows(statement, match | {"upto": upto, "limit": limit})
        return (int(rows[0][2]) if rows else 0), [UnfitRow(int(i), str(w)) for i, w, _ in rows]


@dataclass(frozen=True)
class ServerFacts:
    version_num: int
    version: str
    user: str
    database: str
    track_counts: bool
    autovacuum: bool
    notify_queue_usage: float  # share of the NOTIFY queue in use, 0 to 1


@dataclass(frozen=True)
class TableHealth:
    size: int  # bytes, indexes and TOAST included
    live: int  # row versions, from the statistics (0 with track_counts off)
    dead: int
    since_vacuum: float | None  # seconds since the last VACUUM of any kind; None: never
    autovacuum_off: bool  # autovacuum_enabled = false on this table


@dataclass(frozen=True)
class XminHolder:
    """The oldest holder of this database's xmin horizon."""

    kind: Literal["session", "prepared transaction", "replication slot"]
    who: str
    seconds: float | None  # None for a replication slot
    xid_age: int


class DoctorProbes(_Reader):
    """The reads of `doctor` (on an autocommit connection, so a refused probe does not abort
    the others). Each error is a `DatabaseError` whose message has no prefix: it becomes the
    detail of a FAIL line that already names the check."""

    def __init__(self, conn: Connection, names: TableNames) -> None:
        super().__init__(conn, names, None)
        self._claim = Queries(names)["claim"]

    def server(self) -> ServerFacts:
        return ServerFacts(*self._first(self._sql.render("admin_server")))

    def table_health(self, table: QualifiedName) -> TableHealth | None:
        """None when `table` does not exist."""
        quoted = table.identifier().as_string(self._conn)
        rows = self._rows(self._sql.render("admin_table_health"), {"table": quoted})
        return TableHealth(*rows[0]) if rows else None

    def xmin_holder(self) -> XminHolder | None:
        """None when no snapshot, prepared transaction or slot holds the horizon back."""
        rows = self._rows(self._sql.render("admin_xmin_holder"))
        return XminHolder(*rows[0]) if rows else None

    def oldest_ready_by_queue(self) -> dict[str, float]:
        """Per queue with rows in the outbox, seconds since its oldest ready row became due."""
        return {queue: self._oldest_ready(queue) for queue in self._queues("outbox_queues")}

    def queues(self) -> list[str]:
        """Every queue with rows in the outbox, sorted."""
        return sorted(self._queues("outbox_queues"))

    def probe_claim(self, queue: str) -> None:
        """Run the fetcher's own claim statement on `queue` (at most `PROBE_LIMIT` rows, under
        a fresh token), in a transaction that is always rolled back; raise the `DatabaseError`
        it fails with, the one the farm's claims of this queue keep running into.

        Nothing is kept: the leases, counters and whatever triggers wrote go with the rollback.
        SKIP LOCKED passes the rows a farm holds, and the transaction's lock and statement
        timeouts keep the probe from waiting on anything else; while it runs, the farm's claims
        skip the few rows it holds, as they skip each other's.
        """
        limits = {"lock_timeout": PROBE_LOCK_TIMEOUT, "statement_timeout": PROBE_STATEMENT_TIMEOUT}
        params = {
            "queue": queue,
            "limit": PROBE_LIMIT,
            "lease_ttl": PROBE_LEASE_TTL,
            "token": uuid.uuid4(),
            "held": [],
            "far": True,
        }
        try:
            with self._conn.transaction():
                self._conn.execute(self._sql.render("admin_probe_limits"), limits)
                # Binary and fetched, as the fetcher does: a value the client cannot load fails
                # the probe as it fails the claim.
                self._conn.execute(self._claim, params, binary=True).fetchall()
                raise psycopg.Rollback()
        except psycopg.Error as exc:
            raise translate(exc, names=self._names) from exc
