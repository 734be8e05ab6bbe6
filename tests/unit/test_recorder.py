"""The memory recorder of the test kit, without a database: publishes are checked and kept as
the real ones would be written; handlers run on them under the runtime's outcome rules."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from outbox_farm import (
    AckPolicy,
    ConfigurationError,
    ConstantBackoff,
    DeadLetter,
    Farm,
    Message,
    Outcome,
    Reason,
)
from outbox_farm.testing import Recorder, record
from outbox_farm.worker.invoke import HandlerTimeout


def test_publishes_are_recorded_encoded_and_checked_and_the_farm_restored() -> None:
    farm = Farm()
    real = farm.publish
    with record(farm) as rec:
        first = farm.publish(None, {"to": "ada"}, queue="emails", correlation_id="c-1")
        farm.publish(None, "plain text", queue="other", headers={"tenant": "t1"})
        ids = farm.publish_batch(None, [b"\x00raw", b"more"], queue="emails")
        with pytest.raises(ConfigurationError, match="queue must be a non-empty string"):
            farm.publish(None, {}, queue="")
        with pytest.raises(ConfigurationError, match="activate_in or activate_at"):
            farm.publish(None, {}, queue="q", activate_in=1, activate_at=datetime.now(UTC))
        emails = rec.published(queue="emails")
        assert [m.id for m in emails] == [first, *ids]
        assert emails[0].json() == {"to": "ada"}
        assert emails[0].correlation_id == "c-1"
        assert emails[0].content_type == "application/json"
        assert emails[1].body == b"\x00raw"
        other = rec.published(queue="other")[0]
        assert other.text() == "plain text"
        assert other.headers["tenant"] == "t1"
        assert len(rec.published()) == 4
    assert farm.publish == real


def outcomes_of(handler: Callable[[Message], Any], **options: Any) -> tuple[Recorder, list[Any]]:
    farm = Farm()
    farm.handler("q", **options)(handler)
    with record(farm) as rec:
        farm.publish(None, {"n": 1}, queue="q")
        return rec, rec.run(within=3600).runs


def test_retries_follow_the_strategy_until_max_deliveries() -> None:
    def fails(msg: Message) -> None:
        raise ValueError("boom")

    rec, runs = outcomes_of(fails, retry=ConstantBackoff(10), max_deliveries=3)
    assert [str(r.status) for r in runs] == ["retried"] * 3 + ["dead_lettered"]
    assert [r.delay for r in runs[:3]] == [10, 10, 10]
    assert runs[-1].reason is Reason.MAX_DELIVERIES
    assert [m.attempts_count for m in (r.message for r in runs)] == [0, 1, 2, 3]
    assert len(rec.dead_letters) == 1
    assert rec.pending() == []


def test_dead_letter_manual_ack_and_reject_on_error() -> None:
    def rejects(msg: Message) -> None:
        raise DeadLetter("bad input")

    _, runs = outcomes_of(rejects)
    assert (str(runs[0].status), runs[0].reason) == ("dead_lettered", Reason.REJECTED)

    def forgets(msg: Message) -> None:
        pass

    _, runs = outcomes_of(forgets, ack=AckPolicy.MANUAL, max_deliveries=2)
    assert [str(r.status) for r in runs] == ["retried", "retried", "dead_lettered"]
    assert "without ack()" in str(runs[0].error)

    def nacks(msg: Message) -> None:
        msg.nack(7) if msg.deliveries_count == 1 else msg.ack()

    _, runs = outcomes_of(nacks, ack=AckPolicy.MANUAL)
    assert [(str(r.status), r.delay) for r in runs] == [("retried", 7), ("acked", None)]

    def raises(msg: Message) -> None:
        raise KeyError("x")

    _, runs = outcomes_of(raises, ack=AckPolicy.REJECT_ON_ERROR)
    assert runs[0].reason is Reason.REJECTED


def test_an_async_handler_past_its_timeout_is_retried() -> None:
    async def hangs(msg: Message) -> None:
        if msg.deliveries_count == 1:
            await asyncio.sleep(10)  # past its timeout, which cancels it

    _, runs = outcomes_of(hangs, timeout=0.05, retry=ConstantBackoff(1))
    assert [str(r.status) for r in runs] == ["retried", "acked"]
    assert isinstance(runs[0].error, HandlerTimeout)


def test_the_clock_moves_only_within_the_look_ahead() -> None:
    farm = Farm()
    seen: list[int] = []

    @farm.handler("q")
    def handle(msg: Message) -> None:
        seen.append(msg.json())

    with record(farm) as rec:
        farm.publish(None, 1, queue="q", activate_in=30)
        farm.publish(None, 2, queue="q", activate_in=timedelta(hours=1))
        farm.publish(None, 0, queue="q")
        assert rec.run().statuses == ["acked"]
        later = rec.run(within=60)
        assert (later.statuses, later.left) == (["acked"], 1)
        assert later.advanced == pytest.approx(30)
        assert rec.run(within=3600).statuses == ["acked"]
    assert seen == [0, 1, 2]


def test_timers_deduplicate_and_cancel_as_in_the_table() -> None:
    farm = Farm()
    farm.handler("t")(lambda msg: None)
    with record(farm) as rec:
        first = farm.publish(None, "a", queue="t", timer_id="x", activate_in=60)
        assert farm.publish(None, "b", queue="t", timer_id="x") is None  # ignore: kept
        assert farm.publish(None, "c", queue="t", timer_id="x", on_timer_conflict="extend") == (
            first
        )
        assert rec.run().statuses == ["acked"]  # extended to now
        farm.publish(None, "d", queue="t", timer_id="y", activate_in=60)
        assert farm.cancel_timer(None, queue="t", timer_id="y") is True
        assert farm.cancel_timer(None, queue="t", timer_id="y") is False
        assert rec.pending() == []


def test_keys_run_in_order_and_a_failing_head_holds_its_key_back() -> None:
    farm = Farm()
    order: list[tuple[str, int]] = []

    @farm.handler("k", retry=ConstantBackoff(5))
    def handle(msg: Message) -> None:
        key, n = msg.ordering_key or "", msg.json()
        if (key, n) == ("a", 0) and msg.attempts_count == 0:
            raise RuntimeError("head of a fails once")
        order.append((key, n))

    with record(farm) as rec:
        farm.publish_batch(None, [0, 1, 2], queue="k", ordering_key="a")
        farm.publish_batch(None, [0, 1], queue="k", ordering_keys=["b", "b"])
        first = rec.run()
        assert order == [("b", 0), ("b", 1)]
        assert first.left == 3
        rec.run(within=5)
    assert order == [("b", 0), ("b", 1), ("a", 0), ("a", 1), ("a", 2)]


def test_batches_middleware_and_the_failure_hook() -> None:
    calls: list[Any] = []

    async def outer(arg: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
        calls.append(("middleware", len(arg)))
        return await call_next(arg)

    def hook(msg: Message, exc: BaseException, outcome: Outcome) -> None:
        calls.append(("hook", msg.json(), type(exc).__name__))

    farm = Farm(middleware=[outer], on_failure=hook)

    @farm.handler("b", batch=10)
    async def batch(msgs: list[Message]) -> None:
        for msg in msgs:
            msg.reject(ValueError("odd")) if msg.json() % 2 else msg.ack()

    with record(farm) as rec:
        farm.publish_batch(None, [1, 2, 3], queue="b")
        result = rec.run()
    assert result.statuses == ["dead_lettered", "acked", "dead_lettered"]
    assert calls == [("middleware", 3), ("hook", 1, "ValueError"), ("hook", 3, "ValueError")]


def test_transactional_handlers_and_unknown_queues_are_refused() -> None:
    farm = Farm()

    @farm.handler("tx", transactional=True)
    async def tx(msg: Message, conn: Any) -> None:
        pass

    with record(farm) as rec:
        with pytest.raises(ConfigurationError, match="needs a database connection"):
            rec.run()
        with pytest.raises(ConfigurationError, match="no handler registered"):
            rec.run(queues=["nope"])
