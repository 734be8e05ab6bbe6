"""Fair shares per key, the same on both stores: a queue with a per-key running limit lets no
fair key (a tenant) have more rows leased than the limit, whatever its backlog, so a row of
another key published after that backlog is taken by the next claim; rows without a fair key
count as one key of their own; the count is shared by every claimer and gives a lease back
when it expires."""

from __future__ import annotations

from collections import Counter

import pytest

from outbox_farm.errors import ConfigurationError
from outbox_farm.limits import ROOM_POLL, Limits
from outbox_farm.message import Message
from outbox_farm.storage import QueueControl, ack
from tests.contract.conftest import LEASE, OnPostgres, Outbox, claim_of


async def limit_keys(outbox: Outbox, queue: str, limits: Limits) -> None:
    """Set `limits` of `queue`, its per-key limit with them (the suite's `limit` sets the
    limits of migration 0012 only)."""
    await outbox.limit(queue, limits)
    conn = getattr(outbox, "conn", None)  # pytest loads the suite's conftest under its own name
    if conn is not None:
        await conn.execute(
            "UPDATE outbox_farm_queues SET key_max_running = %s WHERE target = %s AND queue = %s",
            [limits.key_max_running, str(OnPostgres.NAMES.outbox), queue],
        )


async def keys_of(outbox: Outbox, messages: list[Message]) -> Counter[str | None]:
    """How many of `messages` each fair key has."""
    return Counter([(await outbox.row(msg.id)).fair_key for msg in messages])


async def test_one_keys_backlog_leaves_room_for_a_key_published_after_it(outbox: Outbox) -> None:
    await outbox.publish_batch([{"n": n} for n in range(50)], queue="q", fair_key="a")
    late = await outbox.publish({"n": "b"}, queue="q", fair_key="b")
    await limit_keys(outbox, "q", Limits(key_max_running=2))
    first = await outbox.store.claim_limited(claim_of("q", 10))
    assert await keys_of(outbox, first.messages) == {"a": 2, "b": 1}
    assert late in [msg.id for msg in first.messages]
    # Every key with rows is at its limit: the claim says it was held back, to ask soon.
    assert (first.allowed, first.wait) == (3, ROOM_POLL)


async def test_the_keys_count_is_shared_by_every_claimer(outbox: Outbox) -> None:
    await outbox.publish_batch([{"n": n} for n in range(20)], queue="q", fair_key="a")
    await outbox.publish_batch([{"n": n} for n in range(20)], queue="q", fair_key="b")
    await limit_keys(outbox, "q", Limits(key_max_running=3))
    one = await outbox.store.claim_limited(claim_of("q", 4))
    assert len(one.messages) == 4
    # Another claimer (another token, as another process) gets what is left of each key ...
    two = await outbox.store.claim_limited(claim_of("q", 10))
    assert await keys_of(outbox, one.messages + two.messages) == {"a": 3, "b": 3}
    # ... then nothing, until a row of a key is written: then one row of that key.
    three = await outbox.store.claim_limited(claim_of("q", 10))
    assert three.messages == []
    done = one.messages[0]
    done_key = (await outbox.row(done.id)).fair_key
    written = await outbox.write(ack([done.id], [done.lease_token]))
    assert written.matched == {0}
    four = await outbox.store.claim_limited(claim_of("q", 10))
    assert await keys_of(outbox, four.messages) == {done_key: 1}


async def test_rows_without_a_fair_key_are_one_key_of_their_own(outbox: Outbox) -> None:
    await outbox.publish_batch([{"n": n} for n in range(5)], queue="q")
    await outbox.publish_batch([{"n": n} for n in range(5)], queue="q", fair_key="a")
    await limit_keys(outbox, "q", Limits(key_max_running=2))
    taken = await outbox.store.claim_limited(claim_of("q", 10))
    assert await keys_of(outbox, taken.messages) == {None: 2, "a": 2}


async def test_a_claim_too_small_for_every_key_takes_one_of_each_first(outbox: Outbox) -> None:
    for key in ("a", "b", "c"):
        await outbox.publish_batch([{"n": n} for n in range(5)], queue="q", fair_key=key)
    await limit_keys(outbox, "q", Limits(key_max_running=4))
    taken = await outbox.store.claim_limited(claim_of("q", 3))
    assert await keys_of(outbox, taken.messages) == {"a": 1, "b": 1, "c": 1}


async def test_an_expired_lease_is_taken_again_and_counts_again(outbox: Outbox) -> None:
    await outbox.publish_batch([{"n": n} for n in range(6)], queue="q", fair_key="a")
    await limit_keys(outbox, "q", Limits(key_max_running=2))
    first = await outbox.store.claim_limited(claim_of("q", 10))
    assert len(first.messages) == 2
    assert (await outbox.store.claim_limited(claim_of("q", 10))).messages == []
    await outbox.later(LEASE + 1)
    again = await outbox.store.claim_limited(claim_of("q", 10))  # the dead claimer's rows
    assert sorted(m.id for m in again.messages) == sorted(m.id for m in first.messages)
    assert (await outbox.store.claim_limited(claim_of("q", 10))).messages == []


async def test_an_ordering_key_still_runs_one_at_a_time(outbox: Outbox) -> None:
    await outbox.publish_batch(
        [{"n": n} for n in range(4)], queue="q", fair_key="a", ordering_key="k"
    )
    await limit_keys(outbox, "q", Limits(key_max_running=3))
    taken = await outbox.store.claim_limited(claim_of("q", 10))
    assert len(taken.messages) == 1


async def test_the_per_key_limit_comes_back_with_the_controls(outbox: Outbox) -> None:
    await limit_keys(outbox, "q", Limits(key_max_running=4))
    assert await outbox.store.controls() == {
        "q": QueueControl("q", False, limits=Limits(key_max_running=4))
    }
    assert str(Limits(key_max_running=4)) == "at most 4 running per fair key"


async def test_a_fair_key_is_checked_at_publish(outbox: Outbox) -> None:
    for bad in ("", "x" * 256, 5):
        with pytest.raises(ConfigurationError, match="fair_key"):
            await outbox.publish({}, queue="q", fair_key=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="fair_key"):
        await outbox.publish_batch([{}], queue="q", fair_key="")
