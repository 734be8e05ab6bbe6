"""Per-key ordering against a real Postgres: bad keys are refused before any SQL, and a key
held back by its retrying head leaves the fetcher asleep, not claiming. The runtime's order
itself is tested over the in-memory store, in tests/unit/test_runtime_order.py."""

from __future__ import annotations

import time
import uuid
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY

from outbox_farm import ConfigurationError, ConstantBackoff, Farm, Message
from outbox_farm.metrics import metrics
from outbox_farm.settings import RuntimeSettings
from tests.steps import run_until

metrics()  # register the collectors before the first sample is read


def outbox_count(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM outbox").fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ordering_key": ""}, "ordering_key must be a non-empty string"),
        ({"ordering_key": "k" * 256}, "ordering_key is 256 characters"),
        ({"ordering_keys": ["a"]}, "ordering_keys has 1 keys for 2 bodies"),
        ({"ordering_keys": "ab"}, "ordering_keys takes a sequence"),
        ({"ordering_key": "a", "ordering_keys": ["a", "b"]}, "not both"),
    ],
)
def test_bad_ordering_keys_are_refused_before_any_sql(
    conn: psycopg.Connection[Any], options: dict[str, Any], message: str
) -> None:
    farm = Farm()
    with pytest.raises(ConfigurationError, match=message):
        farm.publish_batch(conn, ["one", "two"], queue="q", **options)
    assert outbox_count(conn) == 0  # and the transaction is still usable


def test_a_key_held_back_by_a_retrying_head_does_not_make_fetchers_spin(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """The held-back row is due but not claimable: the fetcher sleeps until the head is due
    (its claims stay few), and the head's ack wakes it for the next row at once."""
    farm = Farm()
    queue = f"spin_{uuid.uuid4().hex[:8]}"
    head = farm.publish(conn, "head", queue=queue, ordering_key="k")
    second = farm.publish(conn, "second", queue=queue, ordering_key="k")
    conn.commit()
    ran: list[tuple[int, float]] = []
    began = time.monotonic()

    @farm.handler(queue, retry=ConstantBackoff(1.5))
    async def handle(msg: Message) -> None:
        ran.append((msg.id, time.monotonic() - began))
        if msg.attempts_count == 0:
            raise RuntimeError("the head fails once")

    claims = REGISTRY.get_sample_value("outbox_farm_fetch_seconds_count", {"queue": queue}) or 0
    run_until(
        farm, dsn, lambda: len(ran) == 3, "three runs", RuntimeSettings(poll_interval=5.0), 60
    )
    claims = (
        REGISTRY.get_sample_value("outbox_farm_fetch_seconds_count", {"queue": queue}) or 0
    ) - claims
    assert [row_id for row_id, _ in ran] == [head, head, second]
    assert ran[1][1] >= 1.4
    assert ran[2][1] - ran[1][1] < 0.5  # woken by the head's ack, not by the 5 s poll
    assert claims < 20, f"{claims} claims in {ran[2][1]:.1f}s: the fetcher spun"
