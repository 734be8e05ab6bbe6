"""After a load test: wait for the farm to drain, then check the delivery invariants.

    python loadtests/common/checker.py --dsn "$DSN" --metrics-url http://127.0.0.1:9464/metrics

Sources of truth, all in the load test's database plus the farm's /metrics:

- `loadtest_expected`: one row per published message, written by the publisher in the same
  transaction as the outbox row (so a rolled-back publish leaves neither), with the fate the
  message must meet: `success`, or the DLQ `failure_reason` it must end with;
- `loadtest_ledger`: one row per handler run, written by the handler itself;
- the outbox and DLQ tables; the farm's counters (`outbox_farm_*_total`).

Exit status 0 when every invariant holds, 1 when one does not (each violation names its
invariant), 2 when the check could not run. `check()` is the library entry point.

The checks here read the database alone; `counter_checks.py` holds the counters against it,
`invariants.py` names the invariants and renders the report, `ledger.py` holds the load test's
tables and `drain.py` the wait for the drain.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path: the repo root

from loadtests.common.counter_checks import acks, duplicates, metric_pairs
from loadtests.common.drain import wait_for_drain
from loadtests.common.harness import Metrics
from loadtests.common.invariants import Check, Report, queue_rows, quote_ids
from loadtests.common.ledger import Db, DlqState, dlq_state, payload_msg_id
from loadtests.common.scenario import SUCCESS
from loadtests.common.tables import DLQ, OUTBOX
from outbox_farm.names import TableNames

# -- the checks that read the database alone -------------------------------------------------


def _outbox_empty(db: Db) -> Check:
    left = db.rows("SELECT queue, count(*) FROM {outbox} GROUP BY queue ORDER BY queue")
    details = []
    for queue, n in left:
        sample = db.rows(
            "SELECT id, payload FROM {outbox} WHERE queue = %s ORDER BY id LIMIT 5", [queue]
        )
        ids = quote_ids(
            (payload_msg_id(payload) or f"row {row_id}" for row_id, payload in sample), n
        )
        details.append(f"{n} row(s) of queue {queue!r} still in the outbox: {ids}")
    return Check("outbox-empty", not left, details)


def _success_at_least_once(db: Db) -> Check:
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
        f"{n} message(s) of queue {q!r} never succeeded: {quote_ids(ids, n)}"
        for q, n, ids in missing
    ]
    return Check("success-at-least-once", not missing, details)


def _dlq_checks(db: Db, dlq: DlqState) -> list[Check]:
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
        details.append(f"{len(missing)} message(s) missing from the DLQ: {quote_ids(missing)}")
    if repeated:
        details.append(
            f"{len(repeated)} message(s) in the DLQ more than once: {quote_ids(repeated)}"
        )
    if wrong:
        details.append(f"{len(wrong)} message(s) with the wrong failure_reason: {quote_ids(wrong)}")
    never = (
        [
            f"{len(in_dlq_but_success)} message(s) that should succeed are in the DLQ: "
            f"{quote_ids(in_dlq_but_success)}"
        ]
        if in_dlq_but_success
        else []
    )
    return [
        Check("dlq-exactly-once", not details, details),
        Check("successes-never-in-dlq", not never, never),
    ]


def _failures_never_succeed(db: Db) -> Check:
    bad = db.rows(
        """
        SELECT DISTINCT e.msg_id, e.queue FROM loadtest_expected e
        JOIN loadtest_ledger l ON l.msg_id = e.msg_id AND l.outcome = 'success'
        WHERE e.expect <> 'success' ORDER BY e.msg_id
        """
    )
    shown = quote_ids(f"{m} ({q})" for m, q in bad)
    details = [f"{len(bad)} message(s) that should fail succeeded: {shown}"] if bad else []
    return Check("failures-never-succeed", not bad, details)


def _phantoms(db: Db, dlq: DlqState) -> Check:
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
        details.append(f"{len(never)} handler run(s) of unpublished messages: {quote_ids(never)}")
    if moved:
        details.append(f"{len(moved)} handler run(s) on the wrong queue: {quote_ids(moved)}")
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
        details.append(f"{len(strays)} DLQ row(s) of unpublished messages: {quote_ids(strays)}")
    return Check("no-phantom-deliveries", not details, details)


def _flaky(db: Db) -> Check:
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
        [f"{len(bad)} message(s) succeeded before failing fail_times times: {quote_ids(bad)}"]
        if bad
        else []
    )
    return Check("flaky-failed-n-times", not bad, details)


def _max_runs(db: Db) -> Check:
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
    details = (
        [f"{len(bad)} message(s) ran more often than max_runs: {quote_ids(bad)}"] if bad else []
    )
    return Check("max-deliveries-respected", not bad, details)


# -- the check -------------------------------------------------------------------------------


def check(
    conn: psycopg.Connection[Any],
    metrics: Metrics,
    *,
    table: str = OUTBOX,
    dlq_table: str = DLQ,
    killed: Collection[int] = (),
) -> Report:
    """Every invariant over the database behind `conn` and one /metrics scrape (`killed`: the
    pids of worker processes killed during the run, which explain duplicates).

    Read the database first and /metrics last: counters only grow, so a counter bumped just
    after its row was written cannot make a sound state look broken.
    """
    db = Db(conn, TableNames.build(table, dlq_table))
    dlq = dlq_state(db)
    checks = [_outbox_empty(db), _success_at_least_once(db)]
    dup_check, dups = duplicates(db, metrics, killed)
    checks += [dup_check, *_dlq_checks(db, dlq), _failures_never_succeed(db)]
    restarts = metrics.total("outbox_farm_worker_restarts_total")
    checks += [*metric_pairs(metrics, dlq, restarts), acks(db, metrics, restarts)]
    checks += [_phantoms(db, dlq), _flaky(db), _max_runs(db)]
    return Report(checks, queue_rows(db, metrics, dups, dlq), restarts)


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
    parser.add_argument("--table", default=OUTBOX)
    parser.add_argument("--dlq-table", default=DLQ)
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
