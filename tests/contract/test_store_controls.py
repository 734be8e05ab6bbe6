"""The operator's controls of a queue, the same on both stores: a pause holds until resumed or
until its `paused_until` passes on the store's clock."""

from __future__ import annotations

from outbox_farm.storage import QueueControl
from tests.contract.conftest import Outbox


async def test_no_queue_is_paused_until_an_operator_pauses_one(outbox: Outbox) -> None:
    assert await outbox.store.controls() == {}
    await outbox.pause("emails", reason="smtp down")
    controls = await outbox.store.controls()
    assert controls == {"emails": QueueControl("emails", True, None, "smtp down")}
    await outbox.resume("emails")
    assert await outbox.store.controls() == {}


async def test_a_pause_ends_when_its_until_passes(outbox: Outbox) -> None:
    await outbox.pause("emails", until_in=60)
    await outbox.pause("sms", until_in=-1)
    controls = await outbox.store.controls()
    assert list(controls) == ["emails"]
    until = controls["emails"].paused_until
    assert until is not None
    assert until > await outbox.now()
