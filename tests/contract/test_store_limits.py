"""A queue's farm-wide limits, the same on both stores: a claim of a limited queue takes no
more than its rate's bucket and its room under `max_running` allow, shares that budget with
every other claimer, and gets back the part of it a lease held once that lease expires."""

from __future__ import annotations

import math
import time

from outbox_farm.limits import ROOM_POLL, Limits, Rate
from outbox_farm.storage import QueueControl, ack
from tests.contract.conftest import LEASE, Outbox, claim_of


async def limited(outbox: Outbox, limit: int = 10, queue: str = "q") -> tuple[int, int, float]:
    """Claim of a limited queue under a fresh token: (rows taken, allowed, wait)."""
    allowed = await outbox.store.claim_limited(claim_of(queue, limit))
    return len(allowed.messages), allowed.allowed, allowed.wait


async def test_the_limits_come_back_with_the_controls(outbox: Outbox) -> None:
    await outbox.limit("emails", Limits(Rate(6000, 60.0), 5))
    await outbox.pause("sms")
    controls = await outbox.store.controls()
    assert controls == {
        "emails": QueueControl("emails", False, limits=Limits(Rate(6000, 60.0), 5)),
        "sms": QueueControl("sms", True),
    }
    assert str(controls["emails"].limits.rate) == "6000/min"
    await outbox.limit("emails", Limits())
    assert list(await outbox.store.controls()) == ["sms"]


async def test_max_running_is_shared_by_every_claimer(outbox: Outbox) -> None:
    for n in range(10):
        await outbox.publish({"n": n}, queue="q")
    await outbox.limit("q", Limits(max_running=3))
    first = await outbox.store.claim_limited(claim_of("q", 2))
    assert (len(first.messages), first.allowed, first.wait) == (2, 2, 0.0)
    # Another claimer (another token, as another process) gets the one place left ...
    assert await limited(outbox) == (1, 1, ROOM_POLL)
    # ... and then none, until a row is written.
    assert await limited(outbox) == (0, 0, ROOM_POLL)
    msg = first.messages[0]
    written = await outbox.write(ack([msg.id], [msg.lease_token]))
    assert written.matched == {0}
    assert await limited(outbox) == (1, 1, ROOM_POLL)


async def test_an_expired_lease_gives_its_place_back(outbox: Outbox) -> None:
    """A process killed while holding rows frees its part of `max_running` when its leases
    expire: the rows are claimed again, and the limit is reached again, not lowered."""
    for n in range(6):
        await outbox.publish({"n": n}, queue="q")
    await outbox.limit("q", Limits(max_running=3))
    assert (await limited(outbox))[0] == 3
    assert (await limited(outbox))[0] == 0
    await outbox.later(LEASE + 1)
    assert (await limited(outbox))[0] == 3  # the dead claimer's rows, again
    assert (await limited(outbox))[0] == 0


async def test_a_limited_claim_takes_no_more_than_it_asked(outbox: Outbox) -> None:
    for n in range(4):
        await outbox.publish({"n": n}, queue="q")
    await outbox.limit("q", Limits(max_running=100))
    assert await limited(outbox, limit=3) == (3, 3, 0.0)
    # Fewer rows than allowed: the store says nothing held it back.
    assert await limited(outbox, limit=3) == (1, 3, 0.0)


async def test_the_rate_is_a_bucket_refilled_by_the_clock(outbox: Outbox) -> None:
    for n in range(10):
        await outbox.publish({"n": n}, queue="q")
    await outbox.limit("q", Limits(Rate(1, 1.0)))  # a bucket of two tokens, one a second
    assert (await limited(outbox))[:2] == (2, 2)  # a new limit starts full
    taken, allowed, wait = await limited(outbox)
    assert (taken, allowed) == (0, 0)
    assert 0.9 < wait <= 1.0  # a token's time, less what passed since the claim before
    await outbox.later(1.0)
    assert (await limited(outbox))[:2] == (1, 1)
    # A long idle time fills the bucket to its size only: a tenth of a second's worth of the
    # rate, two tokens at least.
    await outbox.later(3600)
    assert (await limited(outbox))[:2] == (2, 2)
    assert (await limited(outbox))[:2] == (0, 0)


async def test_a_rate_allows_a_tenth_of_a_second_at_once(outbox: Outbox) -> None:
    for n in range(30):
        await outbox.publish({"n": n}, queue="q")
    await outbox.limit("q", Limits(Rate(6000, 60.0)))  # 100/s: a bucket of 10
    began = time.monotonic()
    assert (await limited(outbox, limit=25))[:2] == (10, 10)
    taken, allowed, wait = await limited(outbox, limit=25)
    # What the time between the two claims refilled, at most: measured, not assumed short (a
    # busy machine's few milliseconds are tens).
    refilled = math.ceil((time.monotonic() - began) * 100)
    assert taken == allowed <= min(10, refilled)
    assert 0 < wait <= 0.05  # until half the bucket is back: a late claim loses nothing


async def test_both_limits_at_once_allow_the_smaller(outbox: Outbox) -> None:
    for n in range(30):
        await outbox.publish({"n": n}, queue="q")
    await outbox.limit("q", Limits(Rate(6000, 60.0), max_running=4))
    began = time.monotonic()
    assert (await limited(outbox, limit=25))[:2] == (4, 4)
    # The bucket gave 4 of its 10: a limit raised keeps what is left of it (a rate changed
    # would start it full again), plus what 100 rows/s refilled meanwhile: on a busy machine
    # the time between the two claims, measured, not assumed short.
    await outbox.limit("q", Limits(Rate(6000, 60.0), max_running=40))
    taken, allowed, _ = await limited(outbox, limit=25)
    refilled = math.ceil((time.monotonic() - began) * 100)
    assert taken == allowed
    assert 6 <= allowed <= min(10, 6 + refilled)


async def test_a_queue_whose_limits_were_cleared_is_claimed_whole(outbox: Outbox) -> None:
    for n in range(5):
        await outbox.publish({"n": n}, queue="q")
    await outbox.limit("q", Limits(max_running=1))
    await outbox.limit("q", Limits())
    assert await limited(outbox) == (5, 10, 0.0)
