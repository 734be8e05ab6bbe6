"""Which outcome each librdkafka error means for its row (pure: no broker): delivered rows are
acked; a missing topic is unroutable; a record the broker refused goes to the retry strategy and
then the DLQ; anything that leaves the delivery unknown is unconfirmed, and a lost producer state
also makes the target build a new producer."""

from __future__ import annotations

import asyncio

import pytest

kafka = pytest.importorskip("confluent_kafka")

from outbox_farm.relay.base import BrokerReply  # noqa: E402
from outbox_farm.relay.kafka_reports import Reports, delivery, words  # noqa: E402

E = kafka.KafkaError


@pytest.mark.parametrize(
    ("code", "outcome"),
    [
        (E.UNKNOWN_TOPIC_OR_PART, BrokerReply.RETURNED),
        (E._UNKNOWN_TOPIC, BrokerReply.RETURNED),
        (E.MSG_SIZE_TOO_LARGE, BrokerReply.NACKED),
        (E.TOPIC_AUTHORIZATION_FAILED, BrokerReply.NACKED),
        (E.INVALID_RECORD, BrokerReply.NACKED),
        (E._MSG_TIMED_OUT, BrokerReply.UNCONFIRMED),
        (E._PURGE_QUEUE, BrokerReply.UNCONFIRMED),
        (E._PURGE_INFLIGHT, BrokerReply.UNCONFIRMED),
        (E._ALL_BROKERS_DOWN, BrokerReply.UNCONFIRMED),
        (E.PRODUCER_FENCED, BrokerReply.UNCONFIRMED),
        (E.OUT_OF_ORDER_SEQUENCE_NUMBER, BrokerReply.UNCONFIRMED),
    ],
)
def test_each_error_has_its_outcome_with_librdkafkas_words(code: int, outcome: BrokerReply) -> None:
    got = delivery(E(code))
    assert got.outcome is outcome
    assert E(code).name() in str(got.reason)


def test_a_retriable_or_fatal_error_is_unconfirmed_whatever_its_code() -> None:
    assert delivery(E(E.MSG_SIZE_TOO_LARGE, retriable=True)).outcome is BrokerReply.UNCONFIRMED
    assert delivery(E(E.INVALID_RECORD, fatal=True)).outcome is BrokerReply.UNCONFIRMED


def test_words_come_from_the_error_inside_an_exception() -> None:
    exc = kafka.KafkaException(E(E.MSG_SIZE_TOO_LARGE))
    assert words(exc).endswith("(MSG_SIZE_TOO_LARGE)")
    assert words(ValueError("plain")) == "ValueError('plain')"


def test_a_lost_producer_state_is_flagged_and_missing_reports_are_unconfirmed() -> None:
    async def scenario() -> None:
        reports = Reports(asyncio.get_running_loop(), 3)
        reports.report(0, None, None)
        reports.report(1, E(E.PRODUCER_FENCED), None)
        await reports.wait(0, timeout=0.01)  # the third report never comes
        first, second, third = reports.deliveries()
        assert first.outcome is BrokerReply.CONFIRMED
        assert second.outcome is BrokerReply.UNCONFIRMED
        assert reports.state_lost
        assert third.outcome is BrokerReply.UNCONFIRMED
        assert third.reason == "no delivery report"

    asyncio.run(scenario())


def test_a_batch_without_a_report_for_the_stall_is_stuck_and_one_with_reports_is_not() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        stuck = Reports(loop, 2)
        stuck.report(0, None, None)
        began = loop.time()
        assert await stuck.wait(0, timeout=30, stall=0.05) is False  # record 1: no report
        assert loop.time() - began < 10  # the stall, not the timeout
        done = Reports(loop, 2)
        loop.call_later(0.02, done.report, 0, None, None)
        loop.call_later(0.04, done.report, 1, None, None)
        assert await done.wait(0, timeout=30, stall=5) is True
        assert [d.outcome for d in done.deliveries()] == [BrokerReply.CONFIRMED] * 2

    asyncio.run(scenario())
