"""The delivery invariants by name, and what checking them yields: a verdict per invariant
(`Check`) and the run's `Report`, with its table per queue.

Kept apart from the checks (`checker.py` reads the database alone, `counter_checks.py` holds
/metrics against it) so that both report alike, and a caller (the load test, the chaos suite,
a test) can read a report without knowing how it was made.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from loadtests.common.harness import Metrics, align
from loadtests.common.ledger import Db, DlqState

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


def quote_ids(ids: Iterable[Any], total: int | None = None) -> str:
    """A few of the ids at fault (and how many more): enough to look one up, short enough to
    read when thousands broke."""
    ids = list(ids)
    shown = ", ".join(str(i) for i in ids[:SAMPLE_IDS])
    more = (total if total is not None else len(ids)) - min(len(ids), SAMPLE_IDS)
    return shown + (f" (+{more} more)" if more > 0 else "")


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


def queue_rows(db: Db, metrics: Metrics, dups: dict[str, int], dlq: DlqState) -> list[QueueRow]:
    """The table's figures, per queue: `dups` and `dlq` are what the checks already read, so
    the table shows the very state they judged."""
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
