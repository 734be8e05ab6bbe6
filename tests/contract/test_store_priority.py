"""Priorities, the same on both stores: among a queue's due rows, higher first, for at most
three quarters of each claim (rounded at random: a 4-row claim keeps exactly one row); the rest
of the claim in plain due order, whatever the priority, so rows of priority 0 keep moving; an
ordering key's order before any priority; a row's priority kept through its retries."""

from __future__ import annotations

from outbox_farm import storage
from tests.contract.conftest import Outbox


async def plain_rows(outbox: Outbox, count: int, queue: str = "q") -> list[int]:
    """`count` rows of priority 0, each published on its own (each its own due time)."""
    ids = [await outbox.publish(f"plain {n}".encode(), queue=queue) for n in range(count)]
    return [row_id for row_id in ids if row_id is not None]


async def test_a_claim_takes_the_highest_priorities_first_and_a_quarter_in_due_order(
    outbox: Outbox,
) -> None:
    p1, p2, p3, p4 = await plain_rows(outbox, 4)
    low = await outbox.publish_batch([b"l1", b"l2"], queue="q", priority=1)
    high = await outbox.publish_batch([b"h1", b"h2", b"h3"], queue="q", priority=5)
    first = {m.id for m in await outbox.claim(limit=4)}
    assert first == {*high, p1}  # three by priority, the fourth the oldest due
    second = {m.id for m in await outbox.claim(limit=4)}
    assert second == {*low, p2, p3}  # what ranks above 0 is left, then due order
    assert {m.id for m in await outbox.claim(limit=4)} == {p4}


async def test_a_claim_never_takes_a_row_twice_when_ranked_rows_are_also_the_oldest(
    outbox: Outbox,
) -> None:
    """The ranked rows are also at the head of the due order: the plain part of the claim
    walks past them (its own locks do not make it skip them) to the next row instead."""
    high = await outbox.publish_batch([b"h"] * 5, queue="q", priority=2)
    plain = await plain_rows(outbox, 2)
    claimed = [m.id for m in await outbox.claim(limit=4)]
    assert sorted(claimed) == high[:4]
    assert sorted(m.id for m in await outbox.claim(limit=4)) == [high[4], *plain]


async def test_rows_of_priority_0_keep_moving_under_a_steady_load_of_higher_ones(
    outbox: Outbox,
) -> None:
    """Every 4-row claim takes one row in plain due order: the k-th oldest plain row goes in
    the k-th claim, however many higher rows keep arriving (eight for every four claimed)."""
    plain = await plain_rows(outbox, 3)
    for round_ in range(3):
        await outbox.publish_batch([b"h"] * 8, queue="q", priority=3)
        claimed = await outbox.claim(limit=4)
        assert [m.id for m in claimed if m.id in plain] == [plain[round_]]
        token = claimed[0].lease_token
        await outbox.write(storage.ack([m.id for m in claimed], [token] * len(claimed)))
    assert not any([await outbox.find(row_id) for row_id in plain])


async def test_one_row_claims_take_the_plain_due_order_about_one_time_in_four(
    outbox: Outbox,
) -> None:
    """A 1-row claim keeps its row for the plain due order with probability 1/4: over 200
    claims, 50 expected, 20 to 90 is five standard deviations either side."""
    await plain_rows(outbox, 1)  # the oldest row, at the head of the due order
    await outbox.publish_batch([b"h"] * 10, queue="q", priority=2)
    plain_taken = 0
    for _ in range(200):
        [msg] = await outbox.claim(limit=1)
        row = await outbox.row(msg.id)
        plain_taken += row.priority == 0
        await outbox.write(storage.release([msg.id], [msg.lease_token]))
    assert 20 <= plain_taken <= 90


async def test_an_ordering_key_comes_before_any_priority(outbox: Outbox) -> None:
    [older] = await outbox.publish_batch([b"k1"], queue="q", ordering_key="k")
    [urgent] = await outbox.publish_batch([b"k2"], queue="q", ordering_key="k", priority=9)
    other = await outbox.publish(b"other", queue="q", priority=1)
    claimed = await outbox.claim(limit=4)
    assert {m.id for m in claimed} == {older, other}  # `urgent` waits for `older`
    await outbox.write(storage.ack([older], [claimed[0].lease_token]))
    assert [m.id for m in await outbox.claim(limit=4)] == [urgent]


async def test_a_row_keeps_its_priority_through_a_retry(outbox: Outbox) -> None:
    urgent = await outbox.publish(b"urgent", queue="q", priority=7)
    [msg] = await outbox.claim()
    retry = storage.retry([msg.id], [msg.lease_token], delays=[10], ran=[True], started=[None])
    assert (await outbox.write(retry)).matched == {0}
    p1, p2, p3, _p4 = await plain_rows(outbox, 4)  # all due before the retry falls due
    await outbox.later(11)
    assert (await outbox.row(urgent)).priority == 7
    assert {m.id for m in await outbox.claim(limit=4)} == {urgent, p1, p2, p3}


async def test_a_row_not_yet_due_waits_whatever_its_priority(outbox: Outbox) -> None:
    later = await outbox.publish(b"later", queue="q", priority=9, activate_in=60)
    now = await plain_rows(outbox, 1)
    assert [m.id for m in await outbox.claim(limit=4, lease_ttl=600)] == now
    await outbox.later(61)
    assert [m.id for m in await outbox.claim(limit=4)] == [later]


async def test_a_priority_belongs_to_its_queue(outbox: Outbox) -> None:
    [here] = await plain_rows(outbox, 1, queue="q")
    await outbox.publish_batch([b"h"] * 4, queue="elsewhere", priority=9)
    assert [m.id for m in await outbox.claim("q", limit=4)] == [here]


async def test_an_extended_timer_takes_the_new_priority_and_one_without_keeps_it(
    outbox: Outbox,
) -> None:
    timer = await outbox.publish(b"t", queue="q", timer_id="t", activate_in=60)
    assert (await outbox.row(timer)).priority == 0
    moved = await outbox.publish(
        b"t2", queue="q", timer_id="t", on_timer_conflict="extend", activate_in=30, priority=4
    )
    assert moved == timer
    assert (await outbox.row(timer)).priority == 4
    await outbox.publish(b"t3", queue="q", timer_id="t", on_timer_conflict="extend")
    assert (await outbox.row(timer)).priority == 4
