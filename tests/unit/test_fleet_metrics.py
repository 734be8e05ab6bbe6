"""The fleet's per-database metrics: verdicts counted by result, and a process exporting only
the databases it serves, in one registry and merged from the farm's multiprocess files."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from outbox_farm.fleet import metrics
from outbox_farm.fleet.metrics import RESULT_OF, RESULTS, DatabaseObserver, fleet_metrics
from outbox_farm.message import Message
from outbox_farm.observe.base import Observers
from outbox_farm.observe.prometheus import FLUSH_EVERY
from outbox_farm.outcome import Kind, Outcome
from tests.steps import eventually

ROOT = Path(__file__).resolve().parents[2]
MESSAGES = "outbox_farm_database_messages_total"
SERVED = "outbox_farm_database_served"
UP = "outbox_farm_database_up"
SIZE = "outbox_farm_fleet_databases"


def value(name: str, **labels: str) -> float | None:
    """A sample of this process's registry; None when the series is not exported."""
    fleet_metrics()
    return REGISTRY.get_sample_value(name, labels)


def counted(database: str) -> dict[str, float | None]:
    return {result: value(MESSAGES, database=database, result=result) for result in RESULTS}


def exported(database: str) -> list[tuple[str, dict[str, str]]]:
    """Every sample of this process naming `database` (counters' _created aside)."""
    m = fleet_metrics()
    return [
        (s.name, s.labels)
        for family in (m.messages, m.served, m.up)
        for metric in family.collect()
        for s in metric.samples
        if s.labels.get("database") == database and not s.name.endswith("_created")
    ]


def message() -> Message:
    at = datetime.now(UTC)
    return Message(
        id=1,
        queue="q",
        body=b"x",
        headers={},
        deliveries_count=1,
        attempts_count=0,
        created_at=at,
        next_attempt_at=at,
        first_attempt_at=None,
        timer_id=None,
        lease_token=uuid.uuid4(),
        claimed_at=at,
    )


def outcome(kind: Kind) -> Outcome:
    return Outcome(kind, 1, uuid.uuid4(), "q", 1)


def test_every_kind_has_one_of_the_results() -> None:
    assert set(RESULT_OF) == set(Kind)
    assert set(RESULT_OF.values()) == set(RESULTS)


@pytest.mark.parametrize("kind", list(Kind))
def test_each_verdict_counts_under_its_result(kind: Kind) -> None:
    database = f"kind-{kind.value}"
    observer = DatabaseObserver(database)
    before = counted(database)
    assert before == dict.fromkeys(RESULTS, 0.0)  # the series exist from the observer's start
    observer.decided(message(), outcome(kind))  # outside an event loop: written at once
    assert counted(database) == {r: 1.0 if r == RESULT_OF[kind] else 0.0 for r in RESULTS}


def test_the_observer_counts_by_result() -> None:
    observer = DatabaseObserver("by-result")
    kinds = [Kind.ACK] * 3 + [Kind.RETRY] * 2 + [Kind.TERMINAL, Kind.RELEASE, Kind.EXPIRE]
    for kind in kinds:
        observer.decided(message(), outcome(kind))
    assert counted("by-result") == {"acked": 3, "retried": 2, "dead": 1, "released": 2}
    other = DatabaseObserver("by-result")  # a second runtime of the database: counts add up
    other.decided(message(), outcome(Kind.ACK))
    assert value(MESSAGES, database="by-result", result="acked") == 4


def test_in_a_loop_counts_are_flushed_within_the_interval_and_at_the_stop() -> None:
    def acked() -> float | None:
        return value(MESSAGES, database="tallied", result="acked")

    async def scenario() -> None:
        observer = DatabaseObserver("tallied")
        observer.decided(message(), outcome(Kind.ACK))
        observer.decided(message(), outcome(Kind.ACK))
        assert acked() == 0  # tallied, not yet written
        await eventually(lambda: acked() == 2, "the flush", FLUSH_EVERY * 40)
        observer.decided(message(), outcome(Kind.ACK))
        observer.stopped()  # the stop writes what is left at once
        assert acked() == 3

    asyncio.run(scenario())


class Broken:
    def inc(self, amount: float = 1) -> None:
        raise RuntimeError("injected")


def test_a_failing_counter_never_reaches_the_data_path(caplog: pytest.LogCaptureFixture) -> None:
    observer = DatabaseObserver("broken")
    observer._children = (Broken(),) * len(RESULTS)  # type: ignore[assignment]
    fanned = Observers([observer])
    assert fanned.decided == observer.decided  # called without the fan-out's guard: its own
    with caplog.at_level(logging.ERROR, "outbox_farm.observe"):
        fanned.decided(message(), outcome(Kind.ACK))
        fanned.decided(message(), outcome(Kind.RETRY))
        observer.stopped()
    failed = [r for r in caplog.records if getattr(r, "event", None) == "observer_failed"]
    assert len(failed) == 1  # logged once
    assert "DatabaseObserver('broken')" in failed[0].getMessage()


def test_served_exports_six_series_and_unserved_removes_them() -> None:
    metrics.served("one")
    metrics.served("two")
    assert value(SERVED, database="one") == 1
    assert value(UP, database="one") == 0  # until its runtimes run
    assert counted("one") == dict.fromkeys(RESULTS, 0.0)
    assert len(exported("one")) == 6
    metrics.unserved("one")
    assert exported("one") == []
    assert len(exported("two")) == 6  # the others stay
    metrics.unserved("two")
    assert exported("two") == []
    metrics.unserved("never-served")  # nothing to do
    assert exported("never-served") == []


def test_up_toggles_and_is_ignored_for_a_database_not_served() -> None:
    metrics.served("toggled")
    metrics.up("toggled", True)
    assert value(UP, database="toggled") == 1
    metrics.up("toggled", False)
    assert value(UP, database="toggled") == 0
    metrics.up("toggled", True)
    assert value(UP, database="toggled") == 1
    metrics.unserved("toggled")
    metrics.up("toggled", True)  # a late report of a runtime let go
    assert exported("toggled") == []


def test_a_database_two_holders_serve_goes_with_the_last() -> None:
    metrics.served("shared-here")
    metrics.served("shared-here")
    metrics.unserved("shared-here")
    assert value(SERVED, database="shared-here") == 1
    metrics.unserved("shared-here")
    assert exported("shared-here") == []


def test_served_again_in_one_registry_counts_from_zero() -> None:
    """A rate() reads the restart as a counter reset, as for a process that restarted."""
    metrics.served("again")
    DatabaseObserver("again").decided(message(), outcome(Kind.ACK))
    assert value(MESSAGES, database="again", result="acked") == 1
    metrics.unserved("again")
    metrics.served("again")
    assert value(MESSAGES, database="again", result="acked") == 0
    metrics.unserved("again")


def test_fleet_size() -> None:
    metrics.fleet_size(12)
    assert value(SIZE) == 12
    metrics.fleet_size(3)
    assert value(SIZE) == 3


# One process of the farm: the steps it takes, in its own interpreter with the multiprocess
# mode on (picked when prometheus_client is imported), and any warning an error.
PROCESS = """
import json, os, sys, uuid
from outbox_farm.fleet import metrics
from outbox_farm.outcome import Kind, Outcome

for op, *args in json.loads(sys.argv[1]):
    if op == "decided":
        observer = metrics.DatabaseObserver(args[0])
        for kind in args[1]:
            observer.decided(None, Outcome(Kind(kind), 1, uuid.uuid4(), "q", 1))
        observer.stopped()
    elif op == "up":
        metrics.up(*args)
    else:
        getattr(metrics, op)(*args)
print(os.getpid())
"""


def run_process(folder: Path, steps: list[list[Any]]) -> int:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", PROCESS, json.dumps(steps)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


def scrape(folder: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The merged samples, as the arbiter's /metrics renders them."""
    collector = MultiProcessCollector(None, path=str(folder))  # type: ignore[no-untyped-call]
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for metric in collector.collect()  # type: ignore[no-untyped-call]
        for s in metric.samples
    }


def test_the_multiprocess_scrape_merges_processes_per_database(tmp_path: Path) -> None:
    first = run_process(
        tmp_path,
        [
            ["served", "shared"],
            ["served", "first-only"],
            ["up", "shared", True],
            ["decided", "shared", ["ack", "ack", "ack", "terminal"]],
            ["fleet_size", 7],
        ],
    )
    run_process(
        tmp_path,
        [
            ["served", "shared"],
            ["up", "shared", False],  # unreachable from this process
            ["decided", "shared", ["retry", "retry"]],
            ["served", "gone"],
            ["up", "gone", True],
            ["decided", "gone", ["ack"]],
            ["unserved", "gone"],  # in the files still, at neutral values
            ["served", "back"],
            ["decided", "back", ["ack"]],
            ["unserved", "back"],
            ["served", "back"],  # the counter goes on from the file's total
            ["decided", "back", ["release"]],
            ["fleet_size", 8],  # read after the first process's 7
        ],
    )

    def at(name: str, **labels: str) -> float | None:
        return scrape(tmp_path).get((name, tuple(sorted(labels.items()))))

    assert at(SERVED, database="shared") == 2  # processes serving it
    assert at(UP, database="shared") == 1  # one of them runs it
    assert at(SERVED, database="gone") == 0
    assert at(UP, database="gone") == 0
    assert at(SERVED, database="back") == 1
    assert at(MESSAGES, database="shared", result="acked") == 3
    assert at(MESSAGES, database="shared", result="dead") == 1
    assert at(MESSAGES, database="shared", result="retried") == 2
    assert at(MESSAGES, database="shared", result="released") == 0
    assert at(MESSAGES, database="gone", result="acked") == 1
    assert at(MESSAGES, database="back", result="acked") == 1
    assert at(MESSAGES, database="back", result="released") == 1
    assert at(SIZE) == 8
    # Series per database, not per process: no pid label survives the merge.
    assert all("pid" not in dict(labels) for _, labels in scrape(tmp_path))

    # As the arbiter does when it reaps a child.
    mark_process_dead(first, str(tmp_path))  # type: ignore[no-untyped-call]
    assert at(SERVED, database="shared") == 1
    assert at(UP, database="shared") == 0
    assert at(SERVED, database="first-only") is None
    assert at(UP, database="first-only") is None
    assert at(MESSAGES, database="shared", result="acked") == 3  # totals outlive the process
    assert at(SIZE) == 8
