"""The invariants that hold the farm's counters (its /metrics) against the database.

The farm counts what it decided (terminal, acked, lease lost, unconfirmed, ...) and the
database shows what became of each message; each check here requires the two to agree, within
what the counters themselves say may have been lost in between: a duplicate must be paid for by
a lost lease or an unconfirmed write, a terminal decision by a DLQ row, an ack by a success.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection

from loadtests.common.harness import Metrics
from loadtests.common.invariants import Check, quote_ids
from loadtests.common.ledger import Db, DlqState


def duplicates(
    db: Db, metrics: Metrics, killed: Collection[int] = ()
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
            shown = quote_ids(f"{m} (pids {p})" for m, p in examples)
            details.append(
                f"queue {queue!r}: {n} duplicate success(es) > lease_lost_total + "
                f"outcome_unconfirmed_total + runs in killed processes {lost.get(queue, 0):g}; "
                f"duplicated messages include {shown}"
            )
    return Check("duplicates-within-lease-lost", not details, details), dups


def metric_pairs(metrics: Metrics, dlq: DlqState, restarts: float) -> list[Check]:
    """A dead letter is told three times (decided, written, a DLQ row): the accounts may part
    only where a counter says a write was lost, left unconfirmed or failed in between."""
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
        checks.append(skipped_after_restarts("dlq-rows-equal-dlq-written", restarts))
        return checks
    # A DLQ move whose reply was lost archived its row uncounted (outcome_unconfirmed).
    unconfirmed = unconfirmed_by_queue(metrics, "terminal")
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


def acks(db: Db, metrics: Metrics, restarts: float) -> Check:
    """A row is deleted once, so each message that succeeded is acked once; only an ack whose
    reply was lost (unconfirmed) may be missing from acked_total."""
    if restarts:  # a killed worker may die between its ack's commit and its counter
        return skipped_after_restarts("acks-equal-successes", restarts)
    succeeded = {
        str(q): int(n)
        for q, n in db.rows(
            "SELECT queue, count(DISTINCT msg_id) FROM loadtest_ledger "
            "WHERE outcome = 'success' GROUP BY queue"
        )
    }
    acked = {k[0]: v for k, v in metrics.by("outbox_farm_acked_total", "queue").items()}
    unconfirmed = unconfirmed_by_queue(metrics, "ack")
    details = [
        f"queue {q!r}: acked_total {acked.get(q, 0):g} but {succeeded.get(q, 0)} message(s) "
        "succeeded" + (f" ({unconfirmed[q]:g} ack(s) unconfirmed)" if unconfirmed.get(q) else "")
        for q in sorted(set(succeeded) | set(acked))
        if not acked.get(q, 0) <= succeeded.get(q, 0) <= acked.get(q, 0) + unconfirmed.get(q, 0)
    ]
    return Check("acks-equal-successes", not details, details)


def skipped_after_restarts(name: str, restarts: float) -> Check:
    """A counter check that a worker restart makes meaningless: a killed worker may die
    between its commit and its counter."""
    return Check(
        name, True, [f"skipped: {restarts:g} worker restart(s) during the run"], skipped=True
    )


def unconfirmed_by_queue(metrics: Metrics, phase: str) -> dict[str, float]:
    """Outcomes of `phase` re-sent after a lost reply that found their row already gone: the
    first attempt most likely committed, uncounted."""
    return {
        q: v
        for (q, p), v in metrics.by(
            "outbox_farm_outcome_unconfirmed_total", "queue", "phase"
        ).items()
        if p == phase
    }
