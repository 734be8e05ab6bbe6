"""Claims and leases, the same on both stores: a claim counts a delivery and takes a lease;
expired leases come back first, unless their claimer still holds them; a row is taken only
once due; `next_due`, `extend_leases`, `give_back` and `set_aside` as the fetcher and the
heartbeat rely on them."""

from __future__ import annotations

import uuid
from datetime import timedelta

from outbox_farm import storage
from outbox_farm.db.claims import SET_ASIDE_TOKEN
from tests.contract.conftest import LEASE, Outbox, claim_of, close_to


async def test_a_claim_leases_a_row_and_counts_its_delivery(outbox: Outbox) -> None:
    row_id = await outbox.publish(
        {"n": 1}, queue="q", headers={"h": "v"}, correlation_id="c-1", timer_id="t"
    )
    claim = claim_of()
    [msg] = await outbox.store.claim(claim)
    assert (msg.id, msg.queue, msg.body, msg.timer_id) == (row_id, "q", b'{"n":1}', "t")
    assert msg.headers == {"content-type": "application/json", "h": "v", "correlation_id": "c-1"}
    assert (msg.deliveries_count, msg.attempts_count, msg.first_attempt_at) == (1, 0, None)
    assert msg.lease_token == claim.token
    assert msg.start_by == claim.start_by
    row = await outbox.row(row_id)
    assert (row.acquired_token, row.acquired_at, row.deliveries_count) == (
        claim.token,
        msg.claimed_at,
        1,
    )
    assert row.lease_expires_at == msg.claimed_at + timedelta(seconds=LEASE)
    assert (msg.created_at, msg.next_attempt_at) == (row.created_at, row.next_attempt_at)
    assert msg.claimed_epoch == msg.claimed_at.timestamp()
    assert msg.due_epoch == msg.next_attempt_at.timestamp()


async def test_a_claim_takes_at_most_its_limit_of_its_own_queue(outbox: Outbox) -> None:
    ids = await outbox.publish_batch([b"1", b"2", b"3", b"4", b"5"], queue="q")
    [other] = await outbox.publish_batch([b"x"], queue="other")
    sizes, taken = [], []
    for _ in range(4):
        msgs = await outbox.claim(limit=2)
        sizes.append(len(msgs))
        taken += [msg.id for msg in msgs]
    assert sizes == [2, 2, 1, 0]
    assert sorted(taken) == ids
    assert [msg.id for msg in await outbox.claim("other")] == [other]


async def test_a_leased_row_is_taken_again_only_once_its_lease_expired(outbox: Outbox) -> None:
    row_id = await outbox.publish(b"x", queue="q")
    [first] = await outbox.claim()
    assert await outbox.claim() == []
    await outbox.later(LEASE + 1)
    [again] = await outbox.claim()
    assert (again.id, again.deliveries_count) == (row_id, 2)
    assert again.lease_token != first.lease_token


async def test_rows_under_a_held_token_are_never_taken_even_expired(outbox: Outbox) -> None:
    await outbox.publish(b"x", queue="q")
    [msg] = await outbox.claim()
    await outbox.later(LEASE + 1)
    assert await outbox.claim(held=[uuid.uuid4(), msg.lease_token]) == []
    assert [m.id for m in await outbox.claim(held=[uuid.uuid4()])] == [msg.id]


async def test_expired_leases_are_claimed_before_due_rows(outbox: Outbox) -> None:
    leased = await outbox.publish(b"leased", queue="q")
    await outbox.claim(lease_ttl=5)
    due = await outbox.publish(b"due", queue="q")
    await outbox.later(10)
    assert [m.id for m in await outbox.claim(limit=1)] == [leased]
    assert [m.id for m in await outbox.claim(limit=1)] == [due]


async def test_due_rows_are_claimed_in_due_order(outbox: Outbox) -> None:
    last = await outbox.publish(b"3", queue="q", activate_in=3)
    first = await outbox.publish(b"1", queue="q", activate_in=1)
    second = await outbox.publish(b"2", queue="q", activate_in=2)
    await outbox.later(5)
    order = [(await outbox.claim(limit=1))[0].id for _ in range(3)]
    assert order == [first, second, last]


async def test_a_row_is_taken_only_once_it_is_due(outbox: Outbox) -> None:
    at = await outbox.now() + timedelta(seconds=60)
    timer = await outbox.publish(b"at", queue="q", activate_at=at)
    delayed = await outbox.publish(b"in", queue="q", activate_in=30)
    assert await outbox.claim() == []
    await outbox.later(31)
    assert [m.id for m in await outbox.claim(lease_ttl=600)] == [delayed]
    await outbox.later(30)
    [msg] = await outbox.claim()
    assert msg.id == timer
    assert close_to(msg.next_attempt_at, msg.claimed_at - timedelta(seconds=1))


async def test_next_due_is_the_soonest_due_row_or_lease_expiry(outbox: Outbox) -> None:
    assert await outbox.store.next_due("q") is None
    await outbox.publish(b"later", queue="q", activate_in=60)
    assert abs(await outbox.store.next_due("q") - 60) < 1  # type: ignore[operator]
    await outbox.publish(b"now", queue="q")
    assert await outbox.store.next_due("q") <= 0  # type: ignore[operator]
    await outbox.claim()  # takes the due row, for LEASE seconds
    assert abs(await outbox.store.next_due("q") - LEASE) < 1  # type: ignore[operator]


async def test_next_due_leaves_out_a_row_its_key_holds_back(outbox: Outbox) -> None:
    """The second row of a key is due, but no claim may take it while the first runs: only
    the first one's lease counts."""
    await outbox.publish_batch([b"1", b"2"], queue="q", ordering_key="k")
    await outbox.claim()
    assert abs(await outbox.store.next_due("q") - LEASE) < 1  # type: ignore[operator]


async def test_extend_leases_moves_only_the_leases_still_held(outbox: Outbox) -> None:
    kept, lost = await outbox.publish_batch([b"1", b"2"], queue="q")
    token = (await outbox.claim())[0].lease_token
    extended = await outbox.store.extend_leases([kept, lost], [token, uuid.uuid4()], 2 * LEASE)
    assert extended == {kept}
    row = await outbox.row(kept)
    assert close_to(row.lease_expires_at, await outbox.now() + timedelta(seconds=2 * LEASE))
    await outbox.later(LEASE + 1)
    assert [m.id for m in await outbox.claim()] == [lost]


async def test_give_back_frees_rows_and_takes_back_their_deliveries(outbox: Outbox) -> None:
    row_id = await outbox.publish(b"x", queue="q")
    [msg] = await outbox.claim()
    await outbox.store.give_back([row_id], uuid.uuid4())
    row = await outbox.row(row_id)
    assert row.acquired_token == msg.lease_token
    await outbox.store.give_back([row_id], msg.lease_token)
    row = await outbox.row(row_id)
    assert (row.acquired_token, row.lease_expires_at, row.deliveries_count) == (None, None, 0)
    [again] = await outbox.claim()
    assert again.deliveries_count == 1


async def test_a_row_set_aside_is_claimed_again_once_its_time_is_up(outbox: Outbox) -> None:
    row_id = await outbox.publish(b"x", queue="q")
    [msg] = await outbox.claim()
    assert await outbox.store.set_aside([row_id], uuid.uuid4(), 60) == []
    assert await outbox.store.set_aside([row_id], msg.lease_token, 60) == [row_id]
    row = await outbox.row(row_id)
    assert row.acquired_token == SET_ASIDE_TOKEN
    await outbox.later(LEASE + 1)  # the claim's lease would have run out: the set-aside holds
    assert await outbox.claim() == []
    await outbox.later(60)
    [again] = await outbox.claim()
    assert (again.id, again.deliveries_count) == (row_id, 2)


async def test_no_write_is_refused_for_want_of_a_privilege(outbox: Outbox) -> None:
    """The memory store has no privileges; the test database's role holds every one."""
    for write in (storage.ack([], []), storage.release([], [])):
        assert await outbox.store.refusal(write) is None
