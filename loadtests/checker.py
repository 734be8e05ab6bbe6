"""After a load test: wait for the farm to drain, then check the delivery invariants.

    python loadtests/checker.py --dsn "$DSN" --metrics-url http://127.0.0.1:9464/metrics

Sources of truth, all in the load test's database plus the farm's /metrics:

- `loadtest_expected`: one row per published message, written by the publisher in the same
  transaction as the outbox row (so a rolled-back publish leaves neither), with the fate the
  message must meet: `success`, or the DLQ `failure_reason` it must end with;
- `loadtest_ledger`: one row per handler run, written by the handler itself;
- the outbox and DLQ tables; the farm's counters (`outbox_farm_*_total`).

Exit status 0 when every invariant holds, 1 when one does not (each violation names its
invariant), 2 when the check could not run. `check()` is the library entry point.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path: the repo root

from loadtests.harness import Metrics, align
from loadtests.scenario import DLQ_TABLE, SUCCESS, TABLE
from outbox_farm.names import TableNames

SCHEMA = """
CREATE TABLE IF NOT EXISTS loadtest_expected (
    msg_id       text PRIMARY KEY,
    queue        text NOT NULL,
    expect       text NOT NULL,            -- 'success' or the DLQ failure_reason
    fail_times   int NOT NULL DEFAULT 0,   -- handler failures before the success
    max_runs     int,                      -- handler runs allowed (max_deliveries), or NULL
    published_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS loadtest_ledger (
    msg_id  text,
    queue   text,
    outcome text,
    pid     int,
    at      timestamptz DEFAULT now()
);
CREATE INDEX IF NOT EXISTS loadtest_ledger_msg_idx ON loadtest_ledger (msg_id);
"""

INVARIANTS: dict[str, str] = {
    "outbox-empty": "the outbox is empty at the end",
    "success-at-least-once": "every message that should succeed succeeded at least once",
    "duplicates-within-lease-lost": "duplicate successes <= lease_lost_total + "
    "outcome_unconfirmed_total (in all and per queue): a message runs again only after a lost "
    "lease or an unconfirmed write (or, relayed, an unconfirmed publish; or a killed process)",
    "dlq-exactly-once": "every message that should fail is in the DLQ exactly once, with the "
    "expected failure_reason",
    "successes-never-in-dlq": "no message that should succeed is in the DLQ",
    "failures-never-succeed": "no message that should fail has a successful handler run",
    "terminal-equals-dlq-written": "terminal_total == dlq_written_total for every queue and "
    "reason, but for terminal writes lost to another lease, unconfirmed or failed (/metrics)",
    "no-write-failures": "write_failed_total is 0: every outcome decided was written",
    "dlq-rows-equal-dlq-written": "DLQ rows == dlq_written_total for every queue and reason, "
    "but for DLQ moves left unconfirmed",
    "acks-equal-successes": "acked_total <= messages that succeeded <= acked_total + "
    "unconfirmed acks, per queue (a row is deleted once: a lost ack must count as lease_lost, "
    "not as acked)",
    "no-phantom-deliveries": "every message run or dead-lettered was committed by a publisher, "
    "on the queue it was published to (rolled-back publishes never run)",
    "flaky-failed-n-times": "every message with fail_times > 0 failed that often before it "
    "succeeded",
    "max-deliveries-respected": "no message ran its handler more often than its max_runs",
}
SAMPLE_IDS = 5  # message ids quoted per violation


# -- the check -------------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    ok: bool
    details: list[str] = field(default_factory=list)
    skipped: bool = False

    @property
    def description(self) -> str:
        return INVARIANTS[self.name]

    def line(self) -> str:
        status = "SKIP" if self.skipped else "PASS" if self.ok else "FAIL"
        text = f"[{status}] {self.name}: {self.description}"
        return "\n".join([text, *(f"         - {d}" for d in self.details)])


# The per-queue columns that add up to the TOTAL row: counted in the database, then read from
# /metrics (the table shows them in this order, with the DLQ rows between the two).
COUNTED = ("published", "runs", "succeeded", "duplicates")
METERED = {
    "claimed": "outbox_farm_claimed_total",
    "acked": "outbox_farm_acked_total",
    "retried": "outbox_farm_retried_total",
    "lease_lost": "outbox_farm_lease_lost_total",
    "unconfirmed": "outbox_farm_outcome_unconfirmed_total",
    "terminal": "outbox_farm_terminal_total",
    "dlq_written": "outbox_farm_dlq_written_total",
    "write_failed": "outbox_farm_write_failed_total",
}


@dataclass
class QueueRow:
    queue: str
    expect: str = ""
    published: int = 0
    runs: int = 0
    succeeded: int = 0
    duplicates: int = 0
    dlq: Counter[str] = field(default_factory=Counter)
    claimed: float = 0
    acked: float = 0
    retried: float = 0
    lease_lost: float = 0
    unconfirmed: float = 0
    terminal: float = 0
    dlq_written: float = 0
    write_failed: float = 0


@dataclass
class Report:
    checks: list[Check]
    queues: list[QueueRow]
    restarts: float = 0

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def violations(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def table(self) -> str:
        head = ("queue", "expect", "published", "runs", "succeeded", "dup", "dlq", *METERED)
        rows = [head]
        total = QueueRow("TOTAL")
        for q in [*self.queues, total]:
            if q is not total:
                for name in (*COUNTED, *METERED):
                    setattr(total, name, getattr(total, name) + getattr(q, name))
                total.dlq.update(q.dlq)
            rows.append(
                (
                    q.queue,
                    q.expect,
                    *(str(getattr(q, name)) for name in COUNTED),
                    str(sum(q.dlq.values())),
                    *(f"{getattr(q, name):g}" for name in METERED),
                )
            )
        lines = align(rows)
        rule = "-" * len(lines[0])
        return "\n".join([lines[0], rule, *lines[1:-1], rule, lines[-1]])

    def render(self) -> str:
        verdict = (
            "all invariants hold"
            if self.ok
            else f"{len(self.violations)} invariant(s) violated: "
            + ", ".join(c.name for c in self.violations)
        )
        parts = [
            "per queue (published/runs/succeeded/dup/dlq from the database, the rest from "
            "/metrics):",
            self.table(),
            "",
            "invariants:",
            *(c.line() for c in self.checks),
        ]
        if self.restarts:
            parts.append(f"note: {self.restarts:g} worker process restart(s) during the run")
        parts += ["", f"checker: {verdict}"]
        return "\n".join(parts)


def _quote(ids: Iterable[Any], total: int | None = None) -> str:
    ids = list(ids)
    shown = ", ".join(str(i) for i in ids[:SAMPLE_IDS])
    more = (total if total is not None else len(ids)) - min(len(ids), SAMPLE_IDS)
    return shown + (f" (+{more} more)" if more > 0 else "")


def _msg_id(payload: bytes) -> str | None:
    try:
        body = json.loads(bytes(payload))
    except ValueError:
        return None
    value = body.get("id") if isinstance(body, dict) else None
    return str(value) if value is not None else None


class _Db:
    def __init__(self, conn: psycopg.Connection[Any], names: TableNames) -> None:
        self.conn = conn
        ids = names.identifiers()
        self.outbox = ids["outbox"]
        self.dlq = ids["dlq"]

    def rows(self, query: str, params: Any = None) -> list[tuple[Any, ...]]:
        composed = sql.SQL(query).format(outbox=self.outbox, dlq=self.dlq)  # type: ignore[arg-type]
        return self.conn.execute(composed, params).fetchall()


def _outbox_empty(db: _Db) -> Check:
    left = db.rows("SELECT queue, count(*) FROM {outbox} GROUP BY queue ORDER BY queue")
    details = []
    for queue, n in left:
        sample = db.rows(
            "SELECT id, payload FROM {outbox} WHERE queue = %s ORDER BY id LIMIT 5", [queue]
        )
        ids = _quote((_msg_id(payload) or f"row {row_id}" for row_id, payload in sample), n)
        details.append(f"{n} row(s) of queue {queue!r} still in the outbox: {ids}")
    return Check("outbox-empty", not left, details)


def _success_at_least_once(db: _Db) -> Check:
    missing = db.rows(
        """
        SELECT e.queue, count(*), (array_agg(e.msg_id ORDER BY e.msg_id))[1:5]
        FROM loadtest_expected e
        WHERE e.expect = 'success' AND NOT EXISTS (
            SELECT 1 FROM loadtest_ledger l WHERE l.msg_id = e.msg_id AND l.outcome = 'success')
        GROUP BY e.queue ORDER BY e.queue
        """
    )
    details = [
        f"{n} message(s) of queue {q!r} never succeeded: {_quote(ids, n)}" for q, n, ids in missing
    ]
    return Check("success-at-least-once", not missing, details)


def _duplicates(
    db: _Db, metrics: Metrics, killed: Collection[int] = ()
) -> tuple[Check, dict[str, int]]:
    """Every duplicate success must be explained: a lost lease, an outcome re-sent after a
    lost connection, a relayed message whose confirm never came (all counted by the farm), or
    a run in a process that was killed (its ack died with it; `killed` lists those pids, and a
    duplicate with a run in one of them is explained by it)."""
    rows = db.rows(
        """
        SELECT queue, sum(n - 1), sum(least(killed, n - 1)) FROM (
            SELECT msg_id, queue, count(*) AS n,
                   count(*) FILTER (WHERE pid = ANY(%s)) AS killed
            FROM loadtest_ledger WHERE outcome = 'success' GROUP BY msg_id, queue
        ) AS s WHERE n > 1 GROUP BY queue
        """,
        [list(killed)],
    )
    dups = {str(q): int(n) for q, n, _ in rows}
    lost: dict[str, float] = defaultdict(float)
    for queue, _, by_kill in rows:
        lost[str(queue)] += int(by_kill)
    for name in ("outbox_farm_lease_lost_total", "outbox_farm_outcome_unconfirmed_total"):
        for (queue,), value in metrics.by(name, "queue").items():
            lost[queue] += value
    # A relayed message left unconfirmed (its row retried) may have reached the broker: the
    # load test's relays are labelled with their queue's name.
    for (queue,), value in metrics.by("outbox_farm_relay_unconfirmed_total", "target").items():
        lost[queue] += value
    total_dup, total_lost = sum(dups.values()), sum(lost.values())
    details = []
    if total_dup > total_lost:
        details.append(
            f"{total_dup} duplicate success(es) but lease_lost_total + "
            f"outcome_unconfirmed_total + runs in killed processes is {total_lost:g}"
        )
    for queue, n in sorted(dups.items()):
        if n > lost.get(queue, 0):
            examples = db.rows(
                "SELECT msg_id, array_agg(pid) FROM loadtest_ledger WHERE outcome = 'success' "
                "AND queue = %s GROUP BY msg_id HAVING count(*) > 1 ORDER BY msg_id LIMIT 5",
                [queue],
            )
            shown = _quote(f"{m} (pids {p})" for m, p in examples)
            details.append(
                f"queue {queue!r}: {n} duplicate success(es) > lease_lost_total + "
                f"outcome_unconfirmed_total + runs in killed processes {lost.get(queue, 0):g}; "
                f"duplicated messages include {shown}"
            )
    return Check("duplicates-within-lease-lost", not details, details), dups


@dataclass
class _DlqState:
    by_msg: dict[str | None, list[tuple[str, str]]]  # msg_id -> [(queue, reason)]
    by_key: Counter[tuple[str, str]]  # (queue, reason) -> rows


def _dlq_state(db: _Db) -> _DlqState:
    by_msg: dict[str | None, list[tuple[str, str]]] = defaultdict(list)
    by_key: Counter[tuple[str, str]] = Counter()
    for queue, payload, reason in db.rows("SELECT queue, payload, failure_reason FROM {dlq}"):
        by_msg[_msg_id(payload)].append((queue, reason))
        by_key[(queue, reason)] += 1
    return _DlqState(dict(by_msg), by_key)


def _dlq_checks(db: _Db, dlq: _DlqState) -> list[Check]:
    expected = db.rows("SELECT msg_id, queue, expect FROM loadtest_expected ORDER BY msg_id")
    missing: list[str] = []
    repeated: list[str] = []
    wrong: list[str] = []
    in_dlq_but_success: list[str] = []
    for msg_id, queue, expect in expected:
        entries = dlq.by_msg.get(msg_id, [])
        if expect == SUCCESS:
            if entries:
                in_dlq_but_success.append(f"{msg_id} ({queue}: {entries[0][1]})")
            continue
        if not entries:
            missing.append(f"{msg_id} ({queue})")
        elif len(entries) > 1:
            repeated.append(f"{msg_id} ({queue}: {len(entries)} rows)")
        elif entries[0][1] != expect:
            wrong.append(f"{msg_id} ({queue}: {entries[0][1]!r}, expected {expect!r})")
    details = []
    if missing:
        details.append(f"{len(missing)} message(s) missing from the DLQ: {_quote(missing)}")
    if repeated:
        details.append(f"{len(repeated)} message(s) in the DLQ more than once: {_quote(repeated)}")
    if wrong:
        details.append(f"{len(wrong)} message(s) with the wrong failure_reason: {_quote(wrong)}")
    never = (
        [
            f"{len(in_dlq_but_success)} message(s) that should succeed are in the DLQ: "
            f"{_quote(in_dlq_but_success)}"
        ]
        if in_dlq_but_success
        else []
    )
    return [
        Check("dlq-exactly-once", not details, details),
        Check("successes-never-in-dlq", not never, never),
    ]


def _failures_never_succeed(db: _Db) -> Check:
    bad = db.rows(
        """
        SELECT DISTINCT e.msg_id, e.queue FROM loadtest_expected e
        JOIN loadtest_ledger l ON l.msg_id = e.msg_id AND l.outcome = 'success'
        WHERE e.expect <> 'success' ORDER BY e.msg_id
        """
    )
    shown = _quote(f"{m} ({q})" for m, q in bad)
    details = [f"{len(bad)} message(s) that should fail succeeded: {shown}"] if bad else []
    return Check("failures-never-succeed", not bad, details)


def _metric_pairs(metrics: Metrics, dlq: _DlqState, restarts: float) -> list[Check]:
    terminal = metrics.by("outbox_farm_terminal_total", "queue", "reason")
    written = metrics.by("outbox_farm_dlq_written_total", "queue", "reason")
    # Terminal decisions are counted when made; a queue's decisions whose DLQ write was lost
    # to another lease, left unconfirmed or failed explain that many missing dlq_written.
    unwritten: dict[str, float] = defaultdict(float)
    for name, label in (
        ("outbox_farm_lease_lost_total", "phase"),
        ("outbox_farm_outcome_unconfirmed_total", "phase"),
        ("outbox_farm_write_failed_total", "kind"),
    ):
        for (queue, what), value in metrics.by(name, "queue", label).items():
            if what == "terminal":
                unwritten[queue] += value
    missing: dict[str, float] = defaultdict(float)
    for q, r in set(terminal) | set(written):
        missing[q] += terminal.get((q, r), 0) - written.get((q, r), 0)
    details = [
        f"queue {q!r} reason {r!r}: terminal_total {terminal.get((q, r), 0):g} != "
        f"dlq_written_total {written.get((q, r), 0):g}"
        + (f" ({unwritten[q]:g} terminal write(s) not made)" if unwritten.get(q) else "")
        for q, r in sorted(set(terminal) | set(written))
        if terminal.get((q, r), 0) != written.get((q, r), 0)
        and (missing[q] != unwritten.get(q, 0) or written.get((q, r), 0) > terminal.get((q, r), 0))
        # A worker killed between its terminal decision and the DLQ write: decided again
        # elsewhere, counted twice. Only more decisions than writes are explained so.
        and not (restarts and written.get((q, r), 0) <= terminal.get((q, r), 0))
    ]
    checks = [Check("terminal-equals-dlq-written", not details, details)]
    failed = metrics.by("outbox_farm_write_failed_total", "queue", "kind")
    failures = [
        f"queue {q!r}: {n:g} {kind} write(s) failed" for (q, kind), n in sorted(failed.items()) if n
    ]
    checks.append(Check("no-write-failures", not failures, failures))
    if restarts:
        # A killed worker may die between its DLQ commit and its counter: counts may differ.
        checks.append(
            Check(
                "dlq-rows-equal-dlq-written",
                True,
                [f"skipped: {restarts:g} worker restart(s) during the run"],
                skipped=True,
            )
        )
        return checks
    # A DLQ move whose reply was lost archived its row uncounted (outcome_unconfirmed).
    unconfirmed = {
        q: v
        for (q, phase), v in metrics.by(
            "outbox_farm_outcome_unconfirmed_total", "queue", "phase"
        ).items()
        if phase == "terminal"
    }
    extra: dict[str, float] = defaultdict(float)
    for q, r in set(dlq.by_key) | set(written):
        extra[q] += dlq.by_key.get((q, r), 0) - written.get((q, r), 0)
    rows_details = [
        f"queue {q!r} reason {r!r}: {dlq.by_key.get((q, r), 0)} DLQ row(s) but "
        f"dlq_written_total {written.get((q, r), 0):g}"
        for q, r in sorted(set(dlq.by_key) | set(written))
        if dlq.by_key.get((q, r), 0) != written.get((q, r), 0)
        and (
            not 0 <= extra[q] <= unconfirmed.get(q, 0)
            or written.get((q, r), 0) > dlq.by_key.get((q, r), 0)
        )
    ]
    checks.append(Check("dlq-rows-equal-dlq-written", not rows_details, rows_details))
    return checks


def _acks(db: _Db, metrics: Metrics, restarts: float) -> Check:
    if restarts:  # a killed worker may die between its ack's commit and its counter
        return Check(
            "acks-equal-successes",
            True,
            [f"skipped: {restarts:g} worker restart(s) during the run"],
            skipped=True,
        )
    succeeded = {
        str(q): int(n)
        for q, n in db.rows(
            "SELECT queue, count(DISTINCT msg_id) FROM loadtest_ledger "
            "WHERE outcome = 'success' GROUP BY queue"
        )
    }
    acked = {k[0]: v for k, v in metrics.by("outbox_farm_acked_total", "queue").items()}
    unconfirmed = {
        q: v
        for (q, phase), v in metrics.by(
            "outbox_farm_outcome_unconfirmed_total", "queue", "phase"
        ).items()
        if phase == "ack"
    }
    details = [
        f"queue {q!r}: acked_total {acked.get(q, 0):g} but {succeeded.get(q, 0)} message(s) "
        "succeeded" + (f" ({unconfirmed[q]:g} ack(s) unconfirmed)" if unconfirmed.get(q) else "")
        for q in sorted(set(succeeded) | set(acked))
        if not acked.get(q, 0) <= succeeded.get(q, 0) <= acked.get(q, 0) + unconfirmed.get(q, 0)
    ]
    return Check("acks-equal-successes", not details, details)


def _phantoms(db: _Db, dlq: _DlqState) -> Check:
    details = []
    unknown_runs = db.rows(
        """
        SELECT l.msg_id, l.queue, e.queue FROM loadtest_ledger l
        LEFT JOIN loadtest_expected e ON e.msg_id = l.msg_id
        WHERE e.msg_id IS NULL OR e.queue IS DISTINCT FROM l.queue
        ORDER BY l.msg_id
        """
    )
    never = [f"{m} ({q})" for m, q, e in unknown_runs if e is None]
    moved = [f"{m} (published to {e!r}, run by {q!r})" for m, q, e in unknown_runs if e]
    if never:
        details.append(f"{len(never)} handler run(s) of unpublished messages: {_quote(never)}")
    if moved:
        details.append(f"{len(moved)} handler run(s) on the wrong queue: {_quote(moved)}")
    published = (
        {m: q for m, q in db.rows("SELECT msg_id, queue FROM loadtest_expected")}
        if dlq.by_msg
        else {}
    )
    strays = [
        f"{m} ({q})"
        for m, entries in dlq.by_msg.items()
        for q, _ in entries
        if m is None or published.get(m) != q
    ]
    if strays:
        details.append(f"{len(strays)} DLQ row(s) of unpublished messages: {_quote(strays)}")
    return Check("no-phantom-deliveries", not details, details)


def _flaky(db: _Db) -> Check:
    short = db.rows(
        """
        SELECT e.msg_id, e.queue, e.fail_times, (
            SELECT count(*) FROM loadtest_ledger l
            WHERE l.msg_id = e.msg_id AND l.outcome = 'error'
              AND l.at <= (SELECT min(at) FROM loadtest_ledger s
                           WHERE s.msg_id = e.msg_id AND s.outcome = 'success'))
        FROM loadtest_expected e
        WHERE e.fail_times > 0 AND e.expect = 'success'
          AND EXISTS (SELECT 1 FROM loadtest_ledger s
                      WHERE s.msg_id = e.msg_id AND s.outcome = 'success')
        ORDER BY e.msg_id
        """
    )
    bad = [f"{m} ({q}: {n} failure(s) of {f})" for m, q, f, n in short if n < f]
    details = (
        [f"{len(bad)} message(s) succeeded before failing fail_times times: {_quote(bad)}"]
        if bad
        else []
    )
    return Check("flaky-failed-n-times", not bad, details)


def _max_runs(db: _Db) -> Check:
    over = db.rows(
        """
        SELECT e.msg_id, e.queue, e.max_runs, count(l.msg_id)
        FROM loadtest_expected e JOIN loadtest_ledger l ON l.msg_id = e.msg_id
        WHERE e.max_runs IS NOT NULL
        GROUP BY e.msg_id, e.queue, e.max_runs HAVING count(l.msg_id) > e.max_runs
        ORDER BY e.msg_id
        """
    )
    bad = [f"{m} ({q}: {n} runs, max {x})" for m, q, x, n in over]
    details = [f"{len(bad)} message(s) ran more often than max_runs: {_quote(bad)}"] if bad else []
    return Check("max-deliveries-respected", not bad, details)


def _queue_rows(db: _Db, metrics: Metrics, dups: dict[str, int], dlq: _DlqState) -> list[QueueRow]:
    rows: dict[str, QueueRow] = {}

    def row(queue: str) -> QueueRow:
        return rows.setdefault(queue, QueueRow(queue))

    for queue, expect, n in db.rows(
        "SELECT queue, string_agg(DISTINCT expect, '/'), count(*) FROM loadtest_expected "
        "GROUP BY queue"
    ):
        row(queue).expect, row(queue).published = expect, n
    for queue, runs, succeeded in db.rows(
        "SELECT queue, count(*), count(DISTINCT msg_id) FILTER (WHERE outcome = 'success') "
        "FROM loadtest_ledger GROUP BY queue"
    ):
        row(queue).runs, row(queue).succeeded = runs, succeeded
    for queue, n in dups.items():
        row(queue).duplicates = n
    for (queue, reason), n in dlq.by_key.items():
        row(queue).dlq[reason] += n
    for attr, name in METERED.items():
        for (queue,), value in metrics.by(name, "queue").items():
            setattr(row(queue), attr, value)
    return [rows[q] for q in sorted(rows)]


def check(
    conn: psycopg.Connection[Any],
    metrics: Metrics,
    *,
    table: str = TABLE,
    dlq_table: str = DLQ_TABLE,
    killed: Collection[int] = (),
) -> Report:
    """Every invariant over the database behind `conn` and one /metrics scrape (`killed`: the
    pids of worker processes killed during the run, which explain duplicates).

    Read the database first and /metrics last: counters only grow, so a counter bumped just
    after its row was written cannot make a sound state look broken.
    """
    db = _Db(conn, TableNames.build(table, dlq_table))
    dlq = _dlq_state(db)
    checks = [_outbox_empty(db), _success_at_least_once(db)]
    dup_check, dups = _duplicates(db, metrics, killed)
    checks += [dup_check, *_dlq_checks(db, dlq), _failures_never_succeed(db)]
    restarts = metrics.total("outbox_farm_worker_restarts_total")
    checks += [*_metric_pairs(metrics, dlq, restarts), _acks(db, metrics, restarts)]
    checks += [_phantoms(db, dlq), _flaky(db), _max_runs(db)]
    return Report(checks, _queue_rows(db, metrics, dups, dlq), restarts)


def create_schema(conn: psycopg.Connection[Any]) -> None:
    """The load test's own tables (the outbox and DLQ come from `outbox_farm.migrate`)."""
    conn.execute(SCHEMA)


# -- draining --------------------------------------------------------------------------------


@dataclass
class Drain:
    drained: bool
    seconds: float
    outbox_rows: int
    inflight: float


def wait_for_drain(
    conn: psycopg.Connection[Any],
    metrics_url: str | None,
    timeout: float,
    *,
    table: str = TABLE,
    every: float = 1.0,
    say: Callable[[str], None] = lambda line: None,
) -> Drain:
    """Wait (at most `timeout` s) until the outbox is empty, nothing is in flight and neither
    the counters nor the ledger moved between two polls `every` s apart.

    An empty outbox alone is not enough: a slow handler whose row was taken over and acked
    elsewhere is still running, and will still write its ledger row and its lease_lost.
    `conn` must be in autocommit mode, so that every poll sees fresh data.
    """
    outbox = TableNames.build(table).identifiers()["outbox"]
    count_q = sql.SQL("SELECT (SELECT count(*) FROM {}), (SELECT count(*) FROM loadtest_ledger)")
    began = time.monotonic()
    deadline = began + max(timeout, 0)
    previous: object = None
    rows, inflight = -1, -1.0
    for _ in range(100_000):  # bounded by the deadline long before
        counts = conn.execute(count_q.format(outbox)).fetchone()
        rows, ledger = (int(counts[0]), int(counts[1])) if counts else (-1, -1)
        metrics = Metrics.scrape(metrics_url) if metrics_url else Metrics([])
        inflight = metrics.total("outbox_farm_inflight") if metrics is not None else -1.0
        state = (rows, ledger, metrics.counters() if metrics is not None else None)
        if rows == 0 and inflight == 0 and state == previous:
            return Drain(True, time.monotonic() - began, rows, inflight)
        previous = state
        now = time.monotonic()
        if now >= deadline:
            break
        flight = f"{inflight:g}" if inflight >= 0 else "? (no /metrics)"
        say(f"draining: {rows} outbox row(s), {flight} in flight")
        time.sleep(min(every, max(deadline - now, 0.0)))
    return Drain(False, time.monotonic() - began, rows, inflight)


# -- command line ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", required=True, help="the load test's database")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--metrics-url", help="the farm's /metrics, e.g. http://127.0.0.1:9464/metrics"
    )
    source.add_argument("--metrics-file", help="a saved /metrics text instead of --metrics-url")
    parser.add_argument("--drain-timeout", type=float, default=60.0, help="seconds (default 60)")
    parser.add_argument("--table", default=TABLE)
    parser.add_argument("--dlq-table", default=DLQ_TABLE)
    args = parser.parse_args(argv)
    try:
        with psycopg.connect(args.dsn, autocommit=True, connect_timeout=10) as conn:
            drain = wait_for_drain(
                conn,
                args.metrics_url,
                args.drain_timeout,
                table=args.table,
                say=lambda line: print(line, file=sys.stderr),
            )
            state = "drained" if drain.drained else "NOT drained"
            print(f"checker: {state} after {drain.seconds:.1f}s", file=sys.stderr)
            if args.metrics_file:
                with open(args.metrics_file, encoding="utf-8") as file:
                    metrics: Metrics | None = Metrics.parse(file.read())
            else:
                metrics = Metrics.scrape(args.metrics_url)
            if metrics is None:
                print(f"checker: no answer from {args.metrics_url}", file=sys.stderr)
                return 2
            report = check(conn, metrics, table=args.table, dlq_table=args.dlq_table)
    except psycopg.Error as exc:
        print(f"checker: database error: {str(exc).strip()}", file=sys.stderr)
        return 2
    print(report.render())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
