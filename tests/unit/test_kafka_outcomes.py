"""Which outcome each librdkafka error means for its row (pure: no broker): delivered rows are
acked; a missing topic is unroutable; a record the broker refused goes to the retry strategy and
then the DLQ; anything that leaves the delivery unknown is unconfirmed, and a lost producer state
also makes the target build a new producer."""

from __future__ import annotations

import asyncio

import pytest

kafka = pytest.importorskip("confluent_kafka")

from outbox_farm.relay.base import BrokerReply  # noqa: E402
from outbox_farm.relay.kafka import _delivery, _Reports, _words  # noqa: E402

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
    delivery = _delivery(E(code))
    assert delivery.outcome is outcome
    assert E(code).name() in str(delivery.reason)


def test_a_retriable_or_fatal_error_is_unconfirmed_whatever_its_code() -> None:
    assert _delivery(E(E.MSG_SIZE_TOO_LARGE, retriable=True)).outcome is BrokerReply.UNCONFIRMED
    assert _delivery(E(E.INVALID_RECORD, fatal=True)).outcome is BrokerReply.UNCONFIRMED


def test_words_come_from_the_error_inside_an_exception() -> None:
    exc = kafka.KafkaException(E(E.MSG_SIZE_TOO_LARGE))
    assert _words(exc).endswith("(MSG_SIZE_TOO_LARGE)")
    assert _words(ValueError("plain")) == "ValueError('plain')"


def test_a_lost_producer_state_is_flagged_and_missing_reports_are_unconfirmed() -> None:
    async def scenario() -> None:
        reports = _Reports(asyncio.get_running_loop(), 3)
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
