"""Ordering keys, the same on both stores: the rows of one queue and key are claimed one at a
time, in id order; the oldest row left of a key holds the rest back whether it runs, waits for
a retry or is not due yet, until it is deleted; an ack may carry the hand-over, which claims
the next row of each key it deletes a row of."""

from __future__ import annotations

from datetime import timedelta

from outbox_farm import storage
from tests.contract.conftest import LEASE, Outbox, claim_of


async def test_rows_of_a_key_are_claimed_one_at_a_time_in_id_order(outbox: Outbox) -> None:
    k1, k2, k3 = await outbox.publish_batch([b"1", b"2", b"3"], queue="q", ordering_key="k")
    [j1] = await outbox.publish_batch([b"j"], queue="q", ordering_key="j")
    free = await outbox.publish(b"free", queue="q")
    [other] = await outbox.publish_batch([b"o"], queue="other", ordering_key="k")
    msgs = await outbox.claim()
    assert sorted(m.id for m in msgs) == [k1, j1, free]
    token = msgs[0].lease_token
    for row_id, following in ((k1, k2), (k2, k3)):
        assert (await outbox.write(storage.ack([row_id], [token]))).matched == {0}
        [msg] = await outbox.claim()
        assert (msg.id, msg.ordering_key) == (following, "k")
        token = msg.lease_token
    assert [m.id for m in await outbox.claim("other")] == [other]


async def test_a_row_waiting_for_its_retry_holds_its_key_back(outbox: Outbox) -> None:
    first, _second = await outbox.publish_batch([b"1", b"2"], queue="q", ordering_key="k")
    [msg] = await outbox.claim()
    retry = storage.retry([first], [msg.lease_token], delays=[30], ran=[True], started=[None])
    assert (await outbox.write(retry)).matched == {0}
    assert await outbox.claim() == []
    await outbox.later(31)
    assert [m.id for m in await outbox.claim()] == [first]


async def test_a_released_row_is_the_next_of_its_key_again(outbox: Outbox) -> None:
    first, _ = await outbox.publish_batch([b"1", b"2"], queue="q", ordering_key="k")
    [msg] = await outbox.claim()
    assert (await outbox.write(storage.release([first], [msg.lease_token]))).matched == {0}
    assert [m.id for m in await outbox.claim()] == [first]


async def test_a_row_not_yet_due_holds_its_key_back(outbox: Outbox) -> None:
    first = await outbox.publish(b"1", queue="q", ordering_key="k", activate_in=60)
    await outbox.publish(b"2", queue="q", ordering_key="k")
    assert await outbox.claim() == []
    await outbox.later(61)
    assert [m.id for m in await outbox.claim()] == [first]


async def test_a_keyed_row_whose_lease_expired_comes_back_before_the_next(
    outbox: Outbox,
) -> None:
    first, _ = await outbox.publish_batch([b"1", b"2"], queue="q", ordering_key="k")
    await outbox.claim(lease_ttl=5)
    await outbox.later(6)
    [again] = await outbox.claim()
    assert (again.id, again.deliveries_count) == (first, 2)


async def test_a_dead_lettered_row_frees_the_next_of_its_key(outbox: Outbox) -> None:
    first, second = await outbox.publish_batch([b"1", b"2"], queue="q", ordering_key="k")
    [msg] = await outbox.claim()
    move = storage.dead_letter([first], [msg.lease_token], reasons=["rejected"], exceptions=[None])
    assert (await outbox.write(move)).matched == {0}
    assert [m.id for m in await outbox.claim()] == [second]


async def test_the_hand_over_claims_the_next_row_of_each_key_with_the_ack(
    outbox: Outbox,
) -> None:
    k1, k2 = await outbox.publish_batch([b"k1", b"k2"], queue="q", ordering_key="k")
    j1, j2 = await outbox.publish_batch([b"j1", b"j2"], queue="q", ordering_key="j")
    token = (await outbox.claim())[0].lease_token
    handover = claim_of(limit=None)
    written = await outbox.write(storage.ack([k1, j1], [token, token]), handover)
    assert written.matched == {0, 1}
    assert sorted(m.id for m in written.claimed) == [k2, j2]
    for msg in written.claimed:
        assert (msg.lease_token, msg.deliveries_count, msg.queue) == (handover.token, 1, "q")
        row = await outbox.row(msg.id)
        assert row.acquired_token == handover.token
        assert row.lease_expires_at == msg.claimed_at + timedelta(seconds=LEASE)
    assert await outbox.claim() == []


async def test_the_hand_over_takes_only_a_free_due_row_of_its_own_queue(outbox: Outbox) -> None:
    """The next row of the key is not due yet, the other queue's is not the hand-over's, the
    unkeyed row frees nothing: nothing is taken; the other queue's next row is then claimed
    as usual."""
    mine = await outbox.publish(b"1", queue="q", ordering_key="k")
    await outbox.publish(b"2", queue="q", ordering_key="k", activate_in=60)
    free = await outbox.publish(b"free", queue="q")
    theirs, following = await outbox.publish_batch([b"1", b"2"], queue="r", ordering_key="k")
    token = (await outbox.claim())[0].lease_token
    their_token = (await outbox.claim("r"))[0].lease_token
    ack = storage.ack([mine, free, theirs], [token, token, their_token])
    written = await outbox.write(ack, claim_of(limit=None))
    assert (written.matched, written.claimed) == ({0, 1, 2}, [])
    assert [m.id for m in await outbox.claim("r")] == [following]
