"""The wake-ups, the same on both stores: Postgres's NOTIFY, and what the memory store tells
its subscribers. A due row's publish wakes its queue's fetchers; so does the deletion of a
keyed row, which may free the next row of its key, unless the hand-over took that row."""

from __future__ import annotations

from outbox_farm import storage
from tests.contract.conftest import Outbox, claim_of


async def test_a_publish_wakes_its_queue_only_when_its_row_is_due(outbox: Outbox) -> None:
    assert await outbox.wakeups(lambda: outbox.publish(b"x", queue="q")) == ["q"]
    assert await outbox.wakeups(lambda: outbox.publish(b"x", queue="q", activate_in=60)) == []
    assert await outbox.wakeups(lambda: outbox.publish(b"x", queue="q", notify=False)) == []
    assert await outbox.wakeups(lambda: outbox.publish_batch([b"1", b"2"], queue="b")) == ["b"]
    await outbox.publish(b"x", queue="q", timer_id="t", activate_in=60)
    assert await outbox.wakeups(lambda: outbox.publish(b"x", queue="q", timer_id="t")) == []


async def test_deleting_a_keyed_row_wakes_its_queue(outbox: Outbox) -> None:
    keyed, _ = await outbox.publish_batch([b"1", b"2"], queue="q", ordering_key="k")
    unkeyed = await outbox.publish(b"free", queue="q")
    moved = await outbox.publish(b"m", queue="r", ordering_key="k")
    token = (await outbox.claim())[0].lease_token
    r_token = (await outbox.claim("r"))[0].lease_token
    assert await outbox.wakeups(lambda: outbox.write(storage.ack([unkeyed], [token]))) == []
    assert await outbox.wakeups(lambda: outbox.write(storage.ack([keyed], [token]))) == ["q"]
    move = storage.dead_letter([moved], [r_token], reasons=["rejected"], exceptions=[None])
    assert await outbox.wakeups(lambda: outbox.write(move)) == ["r"]


async def test_a_hand_over_that_took_every_freed_key_wakes_nobody(outbox: Outbox) -> None:
    k1, k2 = await outbox.publish_batch([b"1", b"2"], queue="q", ordering_key="k")
    j1 = await outbox.publish(b"j1", queue="q", ordering_key="j")
    await outbox.publish(b"j2", queue="q", ordering_key="j", activate_in=60)
    token = (await outbox.claim())[0].lease_token

    async def hand_over(row_id: int) -> storage.Written:
        return await outbox.write(storage.ack([row_id], [token]), claim_of(limit=None))

    assert await outbox.wakeups(lambda: hand_over(k1)) == []  # k2 taken with the ack
    assert await outbox.wakeups(lambda: hand_over(j1)) == ["q"]  # j2 not due: not taken
    assert not await outbox.gone(k2)
