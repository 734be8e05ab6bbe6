"""Locust publishers for the outbox farm load test.

    locust -f loadtests/load/locustfile.py --headless -u 20 -r 20 -t 60s --host "$DSN"
    locust -f loadtests/load/locustfile.py --web-host 127.0.0.1 --host "$DSN"       # web UI

`--host` is the libpq DSN (or postgresql:// URL) of a database migrated by `outbox-farm
migrate` that also holds the load test's tables (`common/ledger.create_schema`);
`run_loadtest.py` prepares all of that, runs the farm and checks the result afterwards.

Each task is one real transaction on the user's own psycopg 3 connection: an INSERT into
`loadtest_expected` (the "domain row", with the message's id and intended fate) and
`farm.publish` of the outbox row, committed together, or (a `--rollback-ratio` share) rolled
back together, which must then never be delivered. Every transaction is reported to Locust as
a request: type `publish` (or `rollback`), name = the queue, so Locust's statistics and web UI
show publish latency and failures per queue.

Options (also in the web UI; environment variables in brackets):
  --queue-weights  ok=55,flaky=15,...  share of each queue     [LOADTEST_QUEUE_WEIGHTS]
  --flaky-failures N                   failures before success [LOADTEST_FLAKY_FAILURES]
  --rollback-ratio F                   share rolled back       [LOADTEST_ROLLBACK_RATIO]
  --publish-rate R                     transactions/s per user [LOADTEST_PUBLISH_RATE]
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import psycopg
from locust import User, constant_throughput, events, task
from locust.env import Environment

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path: the repo root

from loadtests.common import expected, scenario, tables
from outbox_farm import Farm

farm = Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)  # the producer side only


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    parser.add_argument(
        "--queue-weights",
        type=str,
        env_var="LOADTEST_QUEUE_WEIGHTS",
        default=scenario.DEFAULT_WEIGHTS,
        help=f"Share of each queue, NAME=WEIGHT,... (default {scenario.DEFAULT_WEIGHTS})",
    )
    parser.add_argument(
        "--flaky-failures",
        type=int,
        env_var="LOADTEST_FLAKY_FAILURES",
        default=scenario.DEFAULT_FLAKY_FAILURES,
        help="Times each flaky message fails before it succeeds "
        f"(0..{scenario.MAX_FLAKY_FAILURES}, default {scenario.DEFAULT_FLAKY_FAILURES})",
    )
    parser.add_argument(
        "--rollback-ratio",
        type=float,
        env_var="LOADTEST_ROLLBACK_RATIO",
        default=scenario.DEFAULT_ROLLBACK_RATIO,
        help="Share of publish transactions rolled back (never to be delivered; default "
        f"{scenario.DEFAULT_ROLLBACK_RATIO:g})",
    )
    parser.add_argument(
        "--publish-rate",
        type=float,
        env_var="LOADTEST_PUBLISH_RATE",
        default=scenario.DEFAULT_PUBLISH_RATE,
        help="Publish transactions per second per user "
        f"(default {scenario.DEFAULT_PUBLISH_RATE:g})",
    )


@events.init.add_listener
def _validate(environment: Environment, **_: Any) -> None:
    options = environment.parsed_options
    if options is None:  # used as a library without the command line
        return
    try:
        scenario.parse_weights(options.queue_weights)
        scenario.check_flaky_failures(options.flaky_failures)
        scenario.check_rollback_ratio(options.rollback_ratio)
        if not options.publish_rate > 0:
            raise ValueError(f"--publish-rate must be > 0, got {options.publish_rate}")
    except ValueError as exc:
        sys.stderr.write(f"locustfile: {exc}\n")
        sys.exit(2)


class OutboxClient:
    """One psycopg 3 connection that publishes and reports each transaction to Locust."""

    def __init__(self, dsn: str, environment: Environment) -> None:
        self.dsn = dsn
        self.environment = environment
        self.conn: psycopg.Connection[Any] | None = None

    def _connection(self) -> psycopg.Connection[Any]:
        if self.conn is None or self.conn.closed or self.conn.broken:
            self.close()
            self.conn = psycopg.connect(self.dsn, connect_timeout=10, application_name="locust")
        return self.conn

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def publish(self, queue: str, *, fail_times: int = 0, rollback: bool = False) -> None:
        """Publish one message of `queue` with its expectation, in one transaction."""
        length, msg_id = 0, None
        exception: BaseException | None = None
        started = time.perf_counter()
        try:
            conn = self._connection()
            with conn.transaction() as tx:
                [body] = expected.publish(conn, farm, queue, fail_times=fail_times)
                msg_id = body["id"]
                length = len(orjson.dumps(body))
                if rollback:
                    raise psycopg.Rollback(tx)
        except Exception as exc:
            exception = exc
        self.environment.events.request.fire(
            request_type="rollback" if rollback else "publish",
            name=queue,
            response_time=(time.perf_counter() - started) * 1000,
            response_length=length,
            exception=exception,
            context={"msg_id": msg_id},
        )


class Publisher(User):
    """Publishes a weighted mix of the load test's queues at `--publish-rate` per second."""

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        options = environment.parsed_options
        weights = scenario.parse_weights(
            options.queue_weights if options else scenario.DEFAULT_WEIGHTS
        )
        self.queues = [q for q, w in weights.items() if w > 0]
        self.weights = [weights[q] for q in self.queues]
        self.flaky_failures = options.flaky_failures if options else scenario.DEFAULT_FLAKY_FAILURES
        self.rollback_ratio = options.rollback_ratio if options else 0.0
        self.rate = options.publish_rate if options else scenario.DEFAULT_PUBLISH_RATE
        dsn = self.host or os.environ.get("LOADTEST_DSN") or ""
        if not dsn:
            raise ValueError("give the database DSN as --host (or LOADTEST_DSN)")
        self.client = OutboxClient(dsn, environment)

    def wait_time(self) -> float:
        # Locust's constant_throughput keeps its state on the user, so a fresh one per call
        # paces like a single one would.
        return constant_throughput(self.rate)(self)

    @task
    def publish(self) -> None:
        queue = random.choices(self.queues, self.weights)[0]
        self.client.publish(
            queue,
            fail_times=self.flaky_failures if queue == "flaky" else 0,
            rollback=random.random() < self.rollback_ratio,
        )

    def on_stop(self) -> None:
        self.client.close()
