"""Observers plugged into a real runtime: a user's observer sees what the metrics see.

An acked row, a row retried once then acked, and a row rejected to the DLQ: the recorder must
see each claim, start, finish and verdict, and every write the completer made, with the counts
the database shows; and an observer that raises loses no row.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import psycopg
import pytest

from outbox_farm import ConstantBackoff, DeadLetter, Farm, Message, Observer, Outcome
from tests.integration.delivery_kit import DLQ, POLL, Db, database, qname
from tests.steps import eventually, publish


class Recorder(Observer):
    def __init__(self) -> None:
        self.claims = 0
        self.started: list[int] = []
        self.finished = 0
        self.verdicts: list[tuple[int, str]] = []
        self.writes: Counter[str] = Counter()
        self.dead: list[int] = []
        self.flushes = 0

    def claimed(self, queue: str, rows: int, seconds: float) -> None:
        assert seconds >= 0
        self.claims += rows

    def handler_started(self, msg: Message, lag: float) -> None:
        assert lag >= 0
        self.started.append(msg.id)

    def handler_finished(self, queue: str, seconds: float) -> None:
        self.finished += 1

    def decided(self, msg: Message, outcome: Outcome) -> None:
        self.verdicts.append((msg.id, outcome.kind.value))

    def written(self, phase: str, queue: str, rows: int) -> None:
        self.writes[phase] += rows

    def dead_lettered(self, outcome: Outcome) -> None:
        self.dead.append(outcome.row_id)

    def flushed(self, seconds: float, size: int) -> None:
        self.flushes += 1


def test_a_users_observer_sees_every_claim_run_verdict_and_write(
    dsn: str, conn: psycopg.Connection
) -> None:
    farm = Farm(dlq_table=DLQ)
    queue = qname("observed")
    tries: Counter[str] = Counter()

    @farm.handler(queue, retry=ConstantBackoff(0.05))
    async def handle(msg: Message) -> None:
        body = msg.text()
        tries[body] += 1
        if body == "flaky" and tries[body] == 1:
            raise RuntimeError("first try fails")
        if body == "poison":
            raise DeadLetter("never")

    [ok] = publish(conn, ["ok"], queue=queue)
    [flaky] = publish(conn, ["flaky"], queue=queue)
    [poison] = publish(conn, ["poison"], queue=queue)
    recorder = Recorder()

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL, observers=[recorder]):
            await eventually(lambda: _empty(db, queue), "every row handled")
            await eventually(lambda: recorder.writes["ack"] == 2, "both acks written")

    asyncio.run(scenario())
    assert recorder.claims == 4  # the flaky row twice
    assert sorted(recorder.started) == sorted([ok, flaky, flaky, poison])
    assert recorder.finished == 4
    assert sorted(recorder.verdicts) == sorted(
        [(ok, "ack"), (flaky, "retry"), (flaky, "ack"), (poison, "terminal")]
    )
    assert recorder.writes == Counter({"ack": 2, "retry": 1, "terminal": 1})
    assert recorder.dead == [poison]
    assert recorder.flushes >= 2


class Broken(Observer):
    def __init__(self) -> None:
        self.calls = 0

    def decided(self, msg: Message, outcome: Outcome) -> None:
        self.calls += 1
        raise RuntimeError("observer bug")


def test_an_observer_that_raises_is_logged_once_and_loses_no_row(
    dsn: str, conn: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    farm = Farm(dlq_table=DLQ)
    queue = qname("broken_observer")
    handled: list[int] = []

    @farm.handler(queue)
    async def handle(msg: Message) -> None:
        handled.append(msg.id)

    ids = publish(conn, [f"m{i}" for i in range(5)], queue=queue)
    broken = Broken()
    caplog.set_level(logging.ERROR, logger="outbox_farm.observe")

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL, observers=[broken]):
            await eventually(lambda: _empty(db, queue), "every row acked despite the observer")

    asyncio.run(scenario())
    assert sorted(handled) == sorted(ids)
    assert broken.calls == 5
    failures = [r for r in caplog.records if getattr(r, "event", None) == "observer_failed"]
    assert len(failures) == 1, failures


async def _empty(db: Db, queue: str) -> Any:
    return await db.outbox_count(queue) == 0
