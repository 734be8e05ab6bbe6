"""Per-key ordering (`publish(..., ordering_key=...)`) against a real Postgres: rows of one
queue and key run one at a time in id order, a failing row holds its key back until it is
acked or dead-lettered, and rows without a key are not held back by anything."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import defaultdict
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY

from outbox_farm import ConfigurationError, ConstantBackoff, Farm, Message, Retry
from outbox_farm.metrics import metrics
from outbox_farm.settings import RuntimeSettings
from tests.steps import run_until

metrics()  # register the collectors before the first sample is read

SETTINGS = RuntimeSettings(poll_interval=0.05)


class Ledger:
    """What ran, in the order it started, and whether two rows of one key ever overlapped."""

    def __init__(self) -> None:
        self.started: list[tuple[str | None, int]] = []  # (key, row id)
        self.acked: list[tuple[str | None, int]] = []
        self.running: dict[str, int] = {}
        self.overlaps: list[tuple[str, int, int]] = []

    def start(self, key: str | None, row_id: int) -> None:
        if key is not None:
            if key in self.running:
                self.overlaps.append((key, self.running[key], row_id))
            self.running[key] = row_id
        self.started.append((key, row_id))

    def finish(self, key: str | None, row_id: int, ok: bool) -> None:
        if key is not None and self.running.get(key) == row_id:
            del self.running[key]
        if ok:
            self.acked.append((key, row_id))

    def acked_by_key(self) -> dict[str | None, list[int]]:
        out: dict[str | None, list[int]] = defaultdict(list)
        for key, row_id in self.acked:
            out[key].append(row_id)
        return out


def outbox_count(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM outbox").fetchone()
    assert row is not None
    return int(row[0])


def test_rows_of_one_key_run_one_at_a_time_in_publish_order_despite_failures(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    farm = Farm()
    ledger = Ledger()
    rng = random.Random(7)
    keys = [f"order-{k}" for k in range(6)]
    published: dict[str | None, list[int]] = defaultdict(list)
    for n in range(120):
        key = keys[n % len(keys)] if n % 5 else None
        row_id = farm.publish(conn, {"n": n}, queue="q", ordering_key=key)
        assert row_id is not None
        published[key].append(row_id)
    conn.commit()
    total = sum(len(ids) for ids in published.values())

    @farm.handler("q", concurrency=16, retry=ConstantBackoff(0.01), max_deliveries=None)
    async def handle(msg: Message) -> None:
        key = msg.ordering_key
        ledger.start(key, msg.id)
        try:
            await asyncio.sleep(rng.uniform(0, 0.01))  # a random run time: overlaps would show
            if rng.random() < 0.3:
                raise RuntimeError("flaky")
        except RuntimeError:
            ledger.finish(key, msg.id, ok=False)
            raise
        ledger.finish(key, msg.id, ok=True)

    run_until(farm, dsn, lambda: len(ledger.acked) == total, "every row acked", SETTINGS, 60)
    assert ledger.overlaps == []
    acked = ledger.acked_by_key()
    for key in keys:
        assert acked[key] == published[key], f"{key} ran out of order"
    assert sorted(acked[None]) == published[None]
    assert outbox_count(conn) == 0


def test_a_failing_head_holds_its_key_until_dead_lettered_and_others_move_on(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    farm = Farm()
    head = farm.publish(conn, "poison", queue="q", ordering_key="k")
    after = [farm.publish(conn, f"next-{i}", queue="q", ordering_key="k") for i in range(3)]
    free = [farm.publish(conn, f"free-{i}", queue="q") for i in range(3)]
    other = farm.publish(conn, "other key", queue="q", ordering_key="other")
    conn.commit()
    order: list[int] = []
    head_attempts: list[float] = []

    @farm.handler("q", concurrency=8, retry=ConstantBackoff(0.2), max_deliveries=3)
    async def handle(msg: Message) -> None:
        if msg.id == head:
            head_attempts.append(time.monotonic())
            raise RuntimeError("poison")
        order.append(msg.id)

    run_until(farm, dsn, lambda: len(order) == 7, "seven runs", SETTINGS, 60)
    # Rows without a key and rows of another key ran while "k" was held back by its head.
    assert set(order[:4]) == {*free, other}
    assert order[4:] == after
    assert len(head_attempts) == 3
    row = conn.execute(
        "SELECT original_id, failure_reason FROM outbox_dlq WHERE original_id = %s", [head]
    ).fetchone()
    assert row is not None
    assert row[1] == "max_deliveries"
    assert outbox_count(conn) == 0


def test_a_delayed_or_retrying_head_blocks_its_key_but_not_other_keys(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    farm = Farm()
    later = farm.publish(conn, "later", queue="q", ordering_key="k", activate_in=0.6)
    behind = farm.publish(conn, "behind", queue="q", ordering_key="k")
    now = farm.publish(conn, "now", queue="q", ordering_key="j")
    conn.commit()
    ran: list[tuple[int, float]] = []
    began = time.monotonic()

    @farm.handler("q", concurrency=4)
    async def handle(msg: Message) -> None:
        ran.append((msg.id, time.monotonic() - began))

    run_until(farm, dsn, lambda: len(ran) == 3, "three runs", SETTINGS, 60)
    assert [row_id for row_id, _ in ran] == [now, later, behind]
    assert ran[0][1] < 0.5  # key "j" was not held back by "k"'s delayed head


def test_batch_publish_keeps_the_bodies_order_per_key(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    farm = Farm()
    ids = farm.publish_batch(conn, list(range(10)), queue="q", ordering_key="one")
    mixed = farm.publish_batch(
        conn, ["a", "b", "c", "d"], queue="q", ordering_keys=["x", None, "x", "y"]
    )
    conn.commit()
    keys = dict(
        (int(r[0]), r[1]) for r in conn.execute("SELECT id, ordering_key FROM outbox").fetchall()
    )
    assert [keys[i] for i in ids] == ["one"] * 10
    assert [keys[i] for i in mixed] == ["x", None, "x", "y"]
    seen: list[int] = []

    @farm.handler("q", concurrency=8)
    async def handle(msg: Message) -> None:
        seen.append(msg.id)

    run_until(farm, dsn, lambda: len(seen) == 14, "fourteen runs", SETTINGS, 60)
    assert [i for i in seen if i in ids] == ids
    assert [i for i in seen if i in (mixed[0], mixed[2])] == [mixed[0], mixed[2]]


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


def test_a_retry_of_a_keyed_row_keeps_its_place(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """An explicit nack with a delay does not let the next row of the key overtake it."""
    farm = Farm()
    first = farm.publish(conn, "first", queue="q", ordering_key="k")
    second = farm.publish(conn, "second", queue="q", ordering_key="k")
    conn.commit()
    seen: list[int] = []

    @farm.handler("q", concurrency=4)
    async def handle(msg: Message) -> None:
        seen.append(msg.id)
        if msg.id == first and msg.attempts_count == 0:
            raise Retry(0.3)

    run_until(farm, dsn, lambda: seen.count(second) == 1, "the second row's run", SETTINGS, 60)
    assert seen == [first, first, second]


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
