"""The farm under the load test's relay mode: `outbox-farm start loadtests.common.relayapp:farm`
from the repository's root.

    LOADTEST_AMQP=amqp://... LOADTEST_EXCHANGE=x outbox-farm start loadtests.common.relayapp:farm

Two queues, both relayed to the broker of LOADTEST_RELAY (`rabbitmq`, with the routing key
`{queue}`; or `kafka`, to the topic `<LOADTEST_EXCHANGE>.{queue}` keyed by the ordering key):

- `ok`: bound (or its topic made) by the load test's consumer (`relay_consumer.py`), which
  records every message it receives; each must arrive at least once, and none may be acked
  without its confirm;
- `poison`: bound by nothing (no topic, and auto-creation off), so every message comes back
  unroutable; with `NoRetry` each ends in the DLQ as `retry_terminal`, never acked, never
  received.

Each relay's metrics label is its queue's name, so the checker can put an unconfirmed publish
(a message that may have reached the broker) against the queue whose duplicates it explains.
"""

from __future__ import annotations

import os

from loadtests.common import scenario, tables
from outbox_farm import Farm, NoRetry
from outbox_farm.relay import Kafka, RabbitMQ, Target

KIND = os.environ.get("LOADTEST_RELAY", "rabbitmq")
AMQP = os.environ.get("LOADTEST_AMQP", "amqp://guest:guest@127.0.0.1:5672/")
KAFKA = os.environ.get("LOADTEST_KAFKA", "127.0.0.1:9092")
EXCHANGE = os.environ.get("LOADTEST_EXCHANGE", "loadtest_relay")
farm = Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)


def target(queue: str) -> Target:
    if KIND == "kafka":
        # The broker creates no topic: the poison queue's does not exist, and a missing topic
        # is told in a second rather than librdkafka's default 30.
        config = {"allow.auto.create.topics": False, "topic.metadata.propagation.max.ms": 1000}
        return Kafka(KAFKA, topic=f"{EXCHANGE}.{{queue}}", label=queue, config=config)
    return RabbitMQ(AMQP, exchange=EXCHANGE, label=queue)


for queue in scenario.RELAYED:
    farm.relay(queue, to=target(queue), concurrency=2)
for queue in scenario.UNROUTABLE:
    farm.relay(queue, to=target(queue), retry=NoRetry())
