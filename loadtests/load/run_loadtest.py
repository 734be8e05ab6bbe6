"""One whole load test on loopback: scratch database, farm, Locust, drain, check, clean up.

    python loadtests/load/run_loadtest.py                 # 60 s of load, then drain and check
    python loadtests/load/run_loadtest.py --smoke         # the same in well under a minute
    python loadtests/load/run_loadtest.py --ui            # Locust's web UI on 127.0.0.1:8089
    python loadtests/load/run_loadtest.py --relay rabbitmq # the farm relays to RabbitMQ
    python loadtests/load/run_loadtest.py --relay kafka   # ... or to Kafka (tansu, or --kafka)

Steps, each bounded in time: pick the server (--dsn, else OUTBOX_FARM_DSN, else the local
"host=127.0.0.1 user=postgres dbname=postgres", else an embedded Postgres); create a scratch
database there, migrate it and add the load test's tables; start `outbox-farm start
loadtests.common.farmapp:farm --procs N` with its own /metrics port; run Locust
(`locustfile.py`) as a subprocess; wait for the farm to drain; run the checker
(`common/checker.py`) against the database and /metrics; SIGTERM the farm; drop the scratch
database; print the summary. The exit status is 0 only when every invariant held (1 otherwise; 2
when the run itself could not be set up).

With --relay rabbitmq the farm is `common/relayapp.py`, which relays queue `ok` to an exchange
of its own on the broker (--amqp) and queue `poison` to a routing key nothing is bound to (with
--relay kafka: to topics of its own, `poison`'s never created, with auto-creation off); a
consumer (`common/relay_consumer.py`) records every message that arrives in the ledger, so the
same checker verifies that every committed `ok` row reached the broker at least once, that no
row was acked more often than messages arrived, that every duplicate is explained, and that
every unroutable `poison` row ended in the DLQ, never received.

The farm's subprocess is run by `common/farmproc.py`, Locust's by `locust_run.py`; this file
puts the steps in order and judges the run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path: the repo root

from loadtests.common import checker, scenario, tables
from loadtests.common.drain import Drain, wait_for_drain
from loadtests.common.farmproc import the_farm
from loadtests.common.harness import Metrics, SetupError, admin_server, scratch_database
from loadtests.common.invariants import Report
from loadtests.common.ledger import create_schema
from loadtests.common.relaymode import RELAY_WEIGHTS, check_relayed
from loadtests.load.locust_run import locust_table, run_locust
from outbox_farm.dsn import redact

LOCAL_DSN = "host=127.0.0.1 user=postgres dbname=postgres"
LOCAL_AMQP = "amqp://guest:guest@127.0.0.1:5672/"
BOOT_TIMEOUT = 60.0  # for the farm to report all its workers healthy
# Farm log events that mean something broke in the farm itself.
BAD_EVENTS = (
    "worker_crashed",
    "boot_failed",
    "flush_failed",
    "write_failed",
    "strategy_failed",
    "vacuum_failed",
    "vacuum_disabled",
)


def say(line: str) -> None:
    print(f"loadtest: {line}", file=sys.stderr, flush=True)


# -- options ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dsn", help="admin DSN of the server (default: OUTBOX_FARM_DSN, then the local server)"
    )
    parser.add_argument("--duration", type=int, help="seconds of load (default 60; smoke 15)")
    parser.add_argument("--users", type=int, help="Locust users (default 20; smoke 4)")
    parser.add_argument("--spawn-rate", type=float, help="users started per second (default: all)")
    parser.add_argument("--procs", type=int, default=2, help="farm worker processes (default 2)")
    parser.add_argument(
        "--publish-rate",
        type=float,
        default=scenario.DEFAULT_PUBLISH_RATE,
        help=f"transactions/s per user (default {scenario.DEFAULT_PUBLISH_RATE:g})",
    )
    parser.add_argument(
        "--queue-weights",
        help=f"share of each queue (default {scenario.DEFAULT_WEIGHTS}; with --relay "
        f"{RELAY_WEIGHTS})",
    )
    parser.add_argument(
        "--relay",
        choices=("rabbitmq", "kafka"),
        help="relay mode: the farm relays to the broker and a consumer checks what arrived",
    )
    parser.add_argument(
        "--amqp",
        default=os.environ.get("LOADTEST_AMQP", LOCAL_AMQP),
        help="the RabbitMQ of --relay rabbitmq (default: LOADTEST_AMQP, then the local one)",
    )
    parser.add_argument(
        "--kafka",
        default=os.environ.get("LOADTEST_KAFKA", ""),
        help="the Kafka bootstrap servers of --relay kafka (default: LOADTEST_KAFKA, else a "
        "tansu broker started for the run)",
    )
    parser.add_argument("--flaky-failures", type=int, default=scenario.DEFAULT_FLAKY_FAILURES)
    parser.add_argument("--rollback-ratio", type=float, default=scenario.DEFAULT_ROLLBACK_RATIO)
    parser.add_argument(
        "--drain-timeout", type=float, help="seconds to wait for the drain (default 60; smoke 20)"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="a short run: 15 s of load, 4 users, < 60 s in all"
    )
    parser.add_argument(
        "--ui",
        action="store_true",
        help="run Locust's web UI on 127.0.0.1 instead of a headless run; start and stop the "
        "test there, then Ctrl-C (or quit in the UI) to drain and check",
    )
    parser.add_argument("--web-port", type=int, default=8089)
    parser.add_argument(
        "--ui-timeout", type=float, default=3600.0, help="seconds before the UI is closed"
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the scratch database and the work folder"
    )
    args = parser.parse_args(argv)
    defaults = (
        {"duration": 15, "users": 4, "drain_timeout": 20.0}
        if args.smoke
        else {"duration": 60, "users": 20, "drain_timeout": 60.0}
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.spawn_rate is None:
        args.spawn_rate = float(args.users)
    if args.queue_weights is None:
        args.queue_weights = RELAY_WEIGHTS if args.relay else scenario.DEFAULT_WEIGHTS
    try:
        args.weights = scenario.parse_weights(args.queue_weights)
        if args.relay:
            check_relayed(args.weights)
        scenario.check_flaky_failures(args.flaky_failures)
        scenario.check_rollback_ratio(args.rollback_ratio)
    except ValueError as exc:
        parser.error(str(exc))
    if args.duration < 1 or args.users < 1 or args.procs < 1 or args.publish_rate <= 0:
        parser.error("--duration, --users, --procs and --publish-rate must be positive")
    return args


# -- the run ---------------------------------------------------------------------------------


@dataclass
class RunCheck:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"[{'PASS' if self.ok else 'FAIL'}] {self.name}: {self.detail}"


def published_by_queue(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn, connect_timeout=10) as conn:
        rows = conn.execute("SELECT queue, count(*) FROM loadtest_expected GROUP BY queue")
        return {str(q): int(n) for q, n in rows.fetchall()}


def run(args: argparse.Namespace) -> int:
    began = time.monotonic()
    keep_work = args.keep
    work = Path(tempfile.mkdtemp(prefix="outbox-farm-loadtest-"))
    try:
        with (
            admin_server(args.dsn, (os.environ.get("OUTBOX_FARM_DSN"), LOCAL_DSN), say) as admin,
            scratch_database(
                admin,
                tables.NAMES,
                prefix="outbox_farm_load_",
                prepare=create_schema,
                keep=args.keep,
            ) as dsn,
        ):
            say(
                f"scratch database {redact(dsn)}"
                + (" (--keep: not dropped at the end)" if args.keep else "")
            )
            with the_farm(args, dsn, work, say) as (farm, consumer):
                farm.wait_healthy(BOOT_TIMEOUT)
                say(f"farm up: --procs {args.procs}, metrics on {farm.metrics_url}")
                if args.ui:
                    say("load: Locust web UI")
                else:
                    say(f"load: {args.duration}s, {args.users} users x {args.publish_rate:g} tx/s")
                locust_code = run_locust(args, dsn, work, say)
                load_done = time.monotonic()
                with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
                    drain = wait_for_drain(conn, farm.metrics_url, args.drain_timeout, say=say)
                    say(
                        f"{'drained' if drain.drained else 'NOT drained'} in "
                        f"{drain.seconds:.1f}s; checking"
                    )
                    if consumer is not None:
                        consumer.stop()  # after it emptied its queue: all arrived is recorded
                        say(f"relay consumer: {consumer.summary or 'failed (see consumer.log)'}")
                    scraped = Metrics.scrape(farm.metrics_url)
                    report = checker.check(conn, scraped or Metrics([]))
                code, stop_seconds = farm.stop()
                events = farm.events()
                log_tail = farm.log_tail()
            published = published_by_queue(dsn)
        table, failures = locust_table(work / "locust")
        checks = run_checks(args, locust_code, failures, published, drain, code, events, report)
        checks.insert(
            0,
            RunCheck(
                "metrics-scraped",
                scraped is not None,
                "read the farm's /metrics after the drain"
                if scraped is not None
                else "no answer from /metrics: the counter invariants above are meaningless",
            ),
        )
        if consumer is not None:
            checks.append(
                RunCheck(
                    "relay-consumer-finished",
                    consumer.summary is not None,
                    f"received {consumer.summary['received']} message(s), "
                    f"{consumer.summary['distinct']} distinct, then emptied its queue"
                    if consumer.summary
                    else "the consumer did not finish: what arrived is unknown",
                )
            )
        ok = report.ok and all(c.ok for c in checks)
        keep_work = keep_work or not ok
        print_summary(
            args, table, report, checks, events, drain, stop_seconds, load_done - began, began
        )
        if not ok:
            print(f"\nfarm log tail ({work / 'farm.log'}):\n{log_tail}")
            locust_log = work / "locust.log"
            if locust_log.exists():
                tail = "\n".join(locust_log.read_text(errors="replace").splitlines()[-15:])
                print(f"\nLocust log tail ({locust_log}):\n{tail}")
        return 0 if ok else 1
    finally:
        if keep_work:
            say(f"kept the work folder (farm log, Locust CSV): {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def run_checks(
    args: argparse.Namespace,
    locust_code: int | None,
    failures: int,
    published: dict[str, int],
    drain: Drain,
    farm_code: int | None,
    events: Counter[str],
    report: Report,
) -> list[RunCheck]:
    wanted = [q for q, w in args.weights.items() if w > 0]
    unloaded = [q for q in wanted if not published.get(q)]
    bad = {e: events[e] for e in BAD_EVENTS if events[e]}
    locust_ok = locust_code == 0 or (args.ui and locust_code is not None and not failures)
    return [
        RunCheck(
            "load-applied",
            not unloaded,
            f"{sum(published.values())} messages committed"
            + (f"; none for {', '.join(unloaded)}" if unloaded else " on every weighted queue"),
        ),
        RunCheck(
            "publishes-succeeded",
            locust_ok and not failures,
            f"Locust exit status {locust_code}, {failures} failed publish transaction(s)",
        ),
        RunCheck(
            "farm-drained",
            drain.drained,
            f"outbox empty, nothing in flight, counters still, after {drain.seconds:.1f}s"
            if drain.drained
            else f"not within {args.drain_timeout:g}s ({drain.outbox_rows} rows, "
            f"{drain.inflight:g} in flight)",
        ),
        RunCheck(
            "farm-healthy",
            not bad and not report.restarts,
            f"{report.restarts:g} worker restarts; "
            + (f"bad log events {bad}" if bad else "no crash / failed-write events"),
        ),
        RunCheck(
            "farm-stopped-cleanly",
            farm_code == 0,
            f"SIGTERM exit status {farm_code}" if farm_code is not None else "had to be killed",
        ),
    ]


def print_summary(
    args: argparse.Namespace,
    table: str,
    report: Report,
    checks: list[RunCheck],
    events: Counter[str],
    drain: Drain,
    stop_seconds: float,
    until_load_done: float,
    began: float,
) -> None:
    mode = "web UI" if args.ui else f"{args.duration}s"
    print(
        f"\n=== outbox_farm load test: {mode}, {args.users} users x {args.publish_rate:g} tx/s, "
        f"--procs {args.procs}, weights {args.queue_weights}, flaky failures "
        f"{args.flaky_failures}, rollback ratio {args.rollback_ratio:g} ==="
    )
    print("\npublishing (Locust; one request = one transaction):")
    print(table)
    print()
    print(report.render())
    print("\nrun:")
    for c in checks:
        print(c.line())
    notable = ", ".join(
        f"{e}={events[e]}" for e in ("lease_lost", "retry", "terminal", *BAD_EVENTS) if events[e]
    )
    total = time.monotonic() - began
    print(
        f"\nfarm log events: {notable or 'none'}; drain {drain.seconds:.1f}s; SIGTERM stop "
        f"{stop_seconds:.1f}s; wall time {total:.0f}s (setup + load {until_load_done:.0f}s)"
    )
    ok = report.ok and all(c.ok for c in checks)
    broken = [c.name for c in report.violations] + [c.name for c in checks if not c.ok]
    print(f"RESULT: {'PASS' if ok else 'FAIL: ' + ', '.join(broken)}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except SetupError as exc:
        say(f"setup failed: {exc}")
        return 2
    except psycopg.Error as exc:
        say(f"database error: {str(exc).strip()}")
        return 2
    except KeyboardInterrupt:
        say("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
