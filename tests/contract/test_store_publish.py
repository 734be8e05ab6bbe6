"""Publishing, the same on both stores (through the producer's own checks and encoding): timers
are unique per queue and `timer_id`, a batch keeps its bodies' order, and a due time the table
cannot hold is refused."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from outbox_farm import storage
from outbox_farm.errors import DatabaseError
from tests.contract.conftest import Outbox


async def test_a_timer_is_kept_once_per_queue_and_id(outbox: Outbox) -> None:
    first = await outbox.publish(b"first", queue="q", timer_id="t", activate_in=60)
    assert await outbox.publish(b"second", queue="q", timer_id="t") is None
    elsewhere = await outbox.publish(b"elsewhere", queue="r", timer_id="t")
    assert elsewhere is not None
    assert elsewhere != first
    row = await outbox.row(first)
    assert row.payload == b"first"
    assert await outbox.claim() == []  # the kept timer's due time stands


async def test_extend_moves_a_pending_timer_and_leaves_a_running_one(outbox: Outbox) -> None:
    timer = await outbox.publish(b"old", queue="q", timer_id="t", activate_in=60)
    moved = await outbox.publish(
        "new", queue="q", timer_id="t", on_timer_conflict="extend", headers={"h": "v"}
    )
    assert moved == timer
    [msg] = await outbox.claim()
    assert (msg.id, msg.body, msg.headers["h"]) == (timer, b"new", "v")
    assert msg.content_type == "text/plain; charset=utf-8"
    assert (
        await outbox.publish(b"late", queue="q", timer_id="t", on_timer_conflict="extend") is None
    )
    row = await outbox.row(timer)
    assert row.payload == b"new"


async def test_a_timer_id_is_free_again_once_its_row_is_gone(outbox: Outbox) -> None:
    timer = await outbox.publish(b"1", queue="q", timer_id="t")
    [msg] = await outbox.claim()
    await outbox.write(storage.ack([timer], [msg.lease_token]))
    again = await outbox.publish(b"2", queue="q", timer_id="t")
    assert again is not None
    assert again != timer


async def test_only_a_pending_timer_can_be_cancelled(outbox: Outbox) -> None:
    await outbox.publish(b"running", queue="q", timer_id="running")
    await outbox.claim()
    pending = await outbox.publish(b"pending", queue="q", timer_id="pending", activate_in=60)
    assert await outbox.cancel_timer("q", "running") is False
    assert await outbox.cancel_timer("q", "missing") is False
    assert await outbox.cancel_timer("q", "pending") is True
    assert await outbox.gone(pending)


async def test_a_batch_keeps_the_order_of_its_bodies_and_their_keys(outbox: Outbox) -> None:
    bodies: list[object] = [b"raw", "text", {"n": 1}]
    ids = await outbox.publish_batch(bodies, queue="q", ordering_keys=["a", None, "a"])
    assert ids == sorted(ids)
    assert len(ids) == 3
    rows = [await outbox.row(i) for i in ids]
    assert [(r.payload, r.ordering_key) for r in rows] == [
        (b"raw", "a"),
        (b"text", None),
        (b'{"n":1}', "a"),
    ]
    types = [r.headers["content-type"] for r in rows]
    assert types == ["application/octet-stream", "text/plain; charset=utf-8", "application/json"]
    assert len({r.headers["correlation_id"] for r in rows}) == 3  # one each


@pytest.mark.parametrize(
    "when",
    [{"activate_in": 1e12}, {"activate_at": datetime(1, 1, 1, tzinfo=UTC)}],
    ids=["past-year-9999", "year-1"],
)
async def test_a_due_time_the_table_cannot_hold_is_refused(
    outbox: Outbox, when: dict[str, object]
) -> None:
    with pytest.raises(DatabaseError):
        await outbox.publish(b"x", queue="q", **when)  # type: ignore[arg-type]
    assert await outbox.store.next_due("q") is None
