"""The load test's queues and what must become of each message: one place for all of it.

Imported by `farmapp.py` (the farm under test), `load/locustfile.py` (the publishers),
`load/run_loadtest.py` and the chaos and scale suites. `checker.py` takes only SUCCESS from
here (the tables are in `tables.py`): it reads every expectation from the database (the
`loadtest_expected` row written in the same transaction as each outbox row), so a test can
hand it any state.

Queue  | handler                                              | expected fate
-------|------------------------------------------------------|---------------------------------
ok     | succeeds                                             | success
flaky  | fails while attempts_count < fail_times, then works  | success, after fail_times retries
slow   | first delivery sleeps twice its 1 s lease, then works | success, once (the lease heartbeat)
poison | always raises; NoRetry                               | DLQ retry_terminal
reject | raises DeadLetter                                    | DLQ rejected
maxdel | max_deliveries=1; first run hangs past its lease, raises | DLQ max_deliveries

maxdel is deterministic whatever the timing: the only run (deliveries_count 1) hangs for
MAXDEL_HANG > lease_ttl (the heartbeat keeps its lease) and then raises; the retry strategy
(ConstantBackoff, never terminal) schedules it again, and the next claim, deliveries_count 2,
goes to the DLQ as max_deliveries without running the handler. Exactly one handler run, exactly
one DLQ row.

slow outlives its lease on purpose: the heartbeat must keep it, so it succeeds once. Should a
lease still be lost (a stalled worker), every extra success must be paid for by a lease_lost or
an unconfirmed outcome; that is what the checker verifies.
"""

from __future__ import annotations

from dataclasses import dataclass

SUCCESS = "success"  # the other expectations are DLQ failure_reason values

SHORT_LEASE = 1.0  # lease_ttl of slow and maxdel, seconds
SLOW_SLEEP = 2.0  # slow's first delivery: 2x its lease
MAXDEL_HANG = 2.0  # maxdel's only run: 2x its lease
LONG_TIMEOUT = 6.0  # handler timeout of slow and maxdel: longer than the sleep, on purpose
FLAKY_RETRY_DELAY = 0.1
MAX_FLAKY_FAILURES = 10  # flaky's retry strategy gives up after this many failures


@dataclass(frozen=True)
class QueueSpec:
    name: str
    expect: str  # SUCCESS, or the DLQ failure_reason the message must end with
    weight: float  # default share of published messages
    max_runs: int | None = None  # handler runs allowed per message (max_deliveries)


QUEUES: dict[str, QueueSpec] = {
    spec.name: spec
    for spec in (
        QueueSpec("ok", SUCCESS, 55),
        QueueSpec("flaky", SUCCESS, 15),
        QueueSpec("slow", SUCCESS, 10),
        QueueSpec("poison", "retry_terminal", 5),
        QueueSpec("reject", "rejected", 5),
        QueueSpec("maxdel", "max_deliveries", 10, max_runs=1),
    )
}
# The load test's relay mode (`relayapp.py`): queues relayed to the consumer's queue, and
# queues relayed to a routing key nothing is bound to (returned, then dead-lettered).
RELAYED = ("ok",)
UNROUTABLE = ("poison",)
DEFAULT_WEIGHTS = ",".join(f"{q.name}={q.weight:g}" for q in QUEUES.values())
DEFAULT_FLAKY_FAILURES = 2
DEFAULT_ROLLBACK_RATIO = 0.05  # share of publish transactions rolled back
DEFAULT_PUBLISH_RATE = 10.0  # publish transactions per second per Locust user


def parse_weights(text: str) -> dict[str, float]:
    """`ok=60,flaky=10,...` -> weights; queues left out get 0. ValueError on anything odd."""
    weights = dict.fromkeys(QUEUES, 0.0)
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, raw = part.partition("=")
        name = name.strip()
        if not sep or name not in QUEUES:
            raise ValueError(
                f"bad queue weight {part!r}: expected NAME=WEIGHT with NAME one of "
                f"{', '.join(QUEUES)}"
            )
        try:
            weight = float(raw)
        except ValueError:
            raise ValueError(f"bad queue weight {part!r}: {raw!r} is not a number") from None
        if not weight >= 0 or weight == float("inf"):
            raise ValueError(f"bad queue weight {part!r}: must be a finite number >= 0")
        weights[name] = weight
    if not any(weights.values()):
        raise ValueError(f"queue weights {text!r} give every queue 0")
    return weights


def check_flaky_failures(n: int) -> int:
    if not 0 <= n <= MAX_FLAKY_FAILURES:
        raise ValueError(f"flaky failures must be 0..{MAX_FLAKY_FAILURES}, got {n}")
    return n


def check_rollback_ratio(ratio: float) -> float:
    if not 0 <= ratio < 1:
        raise ValueError(f"the rollback ratio must be in [0, 1), got {ratio:g}")
    return ratio
