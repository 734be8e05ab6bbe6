"""Per-key order into Kafka across processes: `outbox-farm start --procs 2` relays rows of many
keys to a 3-partition topic while one route in five fails at random (the row is retried). A
consumer reading the topic finds each key on one partition, its records in publish order."""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox_farm import Farm
from tests.acceptance.drained_farm import drain_with_farm
from tests.integration.brokers import kafka_records, tansu

kafka = pytest.importorskip("confluent_kafka")
admin = pytest.importorskip("confluent_kafka.admin")

KAFKAAPP = '''\
"""Relays queue q to Kafka; one route in five fails at random, so its row is retried."""
import os
import random

from outbox_farm import ConstantBackoff, Farm
from outbox_farm.relay import Kafka

farm = Farm()
seen = []


def topic(envelope):
    if not seen:  # which processes took part
        seen.append(True)
        with open(os.environ["KAFKAAPP_PIDS"], "a") as pids:
            pids.write(f"{os.getpid()}\\n")
    if random.random() < 0.2:
        raise RuntimeError("random route failure")
    return os.environ["KAFKAAPP_TOPIC"]


farm.relay(
    "q",
    to=Kafka(os.environ["KAFKAAPP_SERVERS"], topic=topic),
    batch=20,
    concurrency=4,
    retry=ConstantBackoff(0.005),
    max_deliveries=None,
)
'''


@pytest.fixture(scope="module")
def servers() -> Iterator[str]:
    with tansu() as address:
        yield address


def test_two_processes_keep_each_keys_order_in_kafka(
    tmp_path: Path, dsn: str, conn: psycopg.Connection[Any], servers: str
) -> None:
    topic = f"of_test_{uuid.uuid4().hex[:8]}"
    client = admin.AdminClient({"bootstrap.servers": servers})
    client.create_topics([admin.NewTopic(topic, num_partitions=3)])[topic].result(30)
    farm = Farm()
    published: dict[str, list[int]] = defaultdict(list)
    keys = [f"k{n}" for n in range(30)]
    for n in range(900):
        key = keys[n * 7 % len(keys)]
        farm.publish(conn, b"%d" % n, queue="q", ordering_key=key)
        published[key].append(n)
    conn.commit()
    pids = tmp_path / "pids"
    env = {"KAFKAAPP_SERVERS": servers, "KAFKAAPP_TOPIC": topic, "KAFKAAPP_PIDS": str(pids)}
    drain_with_farm(tmp_path, "kafkaapp", KAFKAAPP, conn, dsn, env=env, timeout=120)

    assert len(set(pids.read_text().split())) == 2, "both processes took part"
    partitions: dict[str, set[int]] = defaultdict(set)
    order: dict[str, list[int]] = defaultdict(list)
    for msg in kafka_records(servers, topic, 900):
        key = msg.key().decode()
        partitions[key].add(msg.partition())
        value = int(msg.value())
        if not order[key] or order[key][-1] != value:  # a re-send follows its first at once
            order[key].append(value)
    assert all(len(p) == 1 for p in partitions.values()), "a key on more than one partition"
    assert len(set().union(*partitions.values())) > 1
    assert dict(order) == dict(published), "a key's records out of publish order"
