"""One rulebook: a rule added once to the decision core is obeyed by every path that decides
what becomes of a row, the executor's one-row loop, its batch loop and the test kit's recorder,
with no database.

The rules are added the way a new one would be written: each wraps the predicate it refines
(`decision.before_run`, `decision.completes`, `decision.raised`), and nothing else changes. A
path that wrote out a rule of its own instead of asking the module would miss it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from outbox_farm import Farm, decision
from outbox_farm.decision import Verdict
from outbox_farm.handler import HandlerSpec
from outbox_farm.message import Message
from outbox_farm.observe import Observer
from outbox_farm.outcome import Kind, Outcome, Reason, describe_exception
from outbox_farm.testing import record
from outbox_farm.testing.results import Run, Status
from outbox_farm.worker.executor import Executors
from outbox_farm.worker.inbox import Inbox
from outbox_farm.worker.inflight import Ledger
from outbox_farm.worker.supervised import Supervisor

# The rows every path is given (body, headers), and what the added rules make of them; the last
# two are the controls: a row no rule touches is acked, and a failure without the header is
# retried as before.
ROWS = {
    b"skip": {},  # dead-lettered unrun (a `before_run` rule): the handler never sees it
    b"hold": {"hold": "1"},  # returns, yet is not acked (a `completes` rule): retried
    b"fatal": {"fatal": "1"},  # raises, and the failure is terminal (a `raised` rule)
    b"plain": {},
    b"boom": {},
}
RULED = {
    b"skip": Status.DEAD_LETTERED,
    b"hold": Status.RETRIED,
    b"fatal": Status.DEAD_LETTERED,
    b"plain": Status.ACKED,
    b"boom": Status.RETRIED,
}
RAISES = {b"fatal", b"boom"}


class Failed(RuntimeError):
    """What the handler raises for the rows in RAISES."""


@pytest.fixture
def rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """The three rules, each added once, to the decision core only."""
    before_run, completes, raised = decision.before_run, decision.completes, decision.raised

    def skip(spec: HandlerSpec, msg: Message) -> Verdict | None:
        if msg.body != b"skip":
            return before_run(spec, msg)
        outcome = Outcome(Kind.TERMINAL, msg.id, msg.lease_token, msg.queue, msg.deliveries_count)
        outcome.reason = Reason.REJECTED
        return outcome, decision.QUIET

    def hold(spec: HandlerSpec, msg: Message) -> bool:
        return "hold" not in msg.headers and completes(spec, msg)

    def fatal(
        spec: HandlerSpec, msg: Message, exc: BaseException, started: float, duration: float
    ) -> Verdict:
        if "fatal" not in msg.headers:
            return raised(spec, msg, exc, started, duration)
        outcome = Outcome(Kind.TERMINAL, msg.id, msg.lease_token, msg.queue, msg.deliveries_count)
        outcome.reason, outcome.last_exception = Reason.REJECTED, describe_exception(exc)
        return outcome, decision.QUIET

    monkeypatch.setattr(decision, "before_run", skip)
    monkeypatch.setattr(decision, "completes", hold)
    monkeypatch.setattr(decision, "raised", fatal)


class Handled:
    """What the handler was given, whichever way it is called."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def one(self, msg: Message) -> None:
        self.bodies.append(msg.body)
        if msg.body in RAISES:
            raise Failed(msg.body.decode())

    async def batch(self, msgs: list[Message]) -> None:
        for msg in msgs:
            await self.one(msg)


class HandedOver:
    """The completer as the executors see it: every outcome handed over, in any of its ways;
    `done` is set once there is one for each of `expected` rows."""

    def __init__(self, expected: int) -> None:
        self.outcomes: list[Outcome] = []
        self.expected = expected
        self.done = asyncio.Event()

    def _take(self, outcomes: list[Outcome]) -> None:
        self.outcomes.extend(outcomes)
        if len(self.outcomes) >= self.expected:
            self.done.set()

    def offer(self, outcome: Outcome) -> bool:
        self._take([outcome])
        return True

    async def put(self, outcome: Outcome) -> None:
        self._take([outcome])

    async def put_all(self, outcomes: list[Outcome]) -> None:
        self._take(outcomes)

    def put_nowait(self, outcome: Outcome) -> None:
        self._take([outcome])


def claimed(row_id: int, body: bytes, headers: dict[str, Any]) -> Message:
    at = datetime.now(UTC)
    return Message(
        id=row_id,
        queue="q",
        body=body,
        headers=headers,
        deliveries_count=1,
        attempts_count=0,
        created_at=at,
        next_attempt_at=at,
        first_attempt_at=None,
        timer_id=None,
        lease_token=uuid.uuid4(),
        claimed_at=at,
        received_monotonic=time.monotonic(),
        claimed_epoch=at.timestamp(),
        due_epoch=at.timestamp(),
    )


async def through_executors(spec: HandlerSpec) -> dict[bytes, Status]:
    """The rows through one queue's executors (real inbox, ledger and loops; the completer
    only collects): what each row's outcome says."""
    observer = Observer()
    inbox: Inbox[Message | None] = Inbox()
    ledger = Ledger(spec.queue, len(ROWS), observer)
    completer = HandedOver(len(ROWS))
    supervisor = Supervisor(on_fatal=lambda reason: None)
    executors = Executors(spec, inbox, ledger, completer, observer)  # type: ignore[arg-type]
    rows = {i: claimed(i, body, headers) for i, (body, headers) in enumerate(ROWS.items(), 1)}
    executors.start(supervisor)
    for msg in rows.values():
        inbox.put_nowait(msg)
    await asyncio.wait_for(completer.done.wait(), 10)
    await executors.stop(time.monotonic() + 5)
    assert supervisor.problem is None  # no loop failed along the way
    return {rows[o.row_id].body: Run.of(rows[o.row_id], o).status for o in completer.outcomes}


def through_recorder(batch: int | None, handled: Handled) -> dict[bytes, Status]:
    farm = Farm()
    farm.handler("q", batch=batch)(handled.one if batch is None else handled.batch)
    with record(farm) as recorder:
        for body, headers in ROWS.items():
            farm.publish(None, body, queue="q", headers=headers)
        return {run.message.body: run.status for run in recorder.run()}


@pytest.mark.usefixtures("rules")
@pytest.mark.parametrize(
    ("path", "batch"),
    [("executor", None), ("executor", 1), ("recorder", None), ("recorder", 1)],
    ids=["one-row loop", "batch loop", "recorder", "recorder, batch handler"],
)
def test_a_rule_added_once_is_obeyed_by_every_path(path: str, batch: int | None) -> None:
    handled = Handled()
    if path == "executor":
        func = handled.one if batch is None else handled.batch
        spec = HandlerSpec(queue="q", func=func, concurrency=1, batch=batch)
        verdicts = asyncio.run(through_executors(spec))
    else:
        verdicts = through_recorder(batch, handled)
    assert verdicts == RULED
    assert sorted(handled.bodies) == sorted(set(ROWS) - {b"skip"})


def test_without_the_rules_every_row_is_run_and_only_failures_retried() -> None:
    """The control: the same rows under the stock rules, on the executors' one-row loop."""
    handled = Handled()
    spec = HandlerSpec(queue="q", func=handled.one, concurrency=1)
    verdicts = asyncio.run(through_executors(spec))
    assert verdicts == {body: Status.RETRIED if body in RAISES else Status.ACKED for body in ROWS}
    assert sorted(handled.bodies) == sorted(ROWS)
