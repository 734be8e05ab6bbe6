"""`message.claimed`, the fetcher's way to build a `Message`, against the dataclass's own
constructor: the same message, every slot set."""

from __future__ import annotations

import dataclasses
import uuid
import weakref
from datetime import UTC, datetime, timedelta

from outbox_farm.message import Message, claimed

CLAIMED = datetime(2026, 11, 27, 12, 0, 0, 123456, tzinfo=UTC)
DUE = CLAIMED - timedelta(seconds=3.5)


def test_a_claimed_message_is_the_one_the_constructor_builds() -> None:
    token = uuid.uuid4()
    values = {
        "id": 42,
        "queue": "orders",
        "body": b'{"n": 1}',
        "headers": {"content-type": "application/json"},
        "deliveries_count": 3,
        "attempts_count": 2,
        "created_at": CLAIMED - timedelta(hours=1),
        "next_attempt_at": DUE,
        "first_attempt_at": CLAIMED - timedelta(minutes=5),
        "timer_id": "t-1",
        "lease_token": token,
        "claimed_at": CLAIMED,
        "ordering_key": "customer-7",
        "received_monotonic": 100.25,
        "start_by": 130.5,
        "claimed_epoch": CLAIMED.timestamp(),
        "invalid": "created_at: out of range",
    }
    fast = claimed(values["id"], *list(values.values())[1:])  # positional, in field order
    slow = Message(**values, due_epoch=DUE.timestamp())
    for field in dataclasses.fields(Message):
        assert getattr(fast, field.name) == getattr(slow, field.name), field.name
    assert (fast.decision, fast.nack_delay, fast.error) == (None, None, None)
    assert set(Message.__slots__) - {"__weakref__"} == {f.name for f in dataclasses.fields(Message)}


def test_a_message_has_no_instance_dict_and_takes_a_weak_reference() -> None:
    """Slots only: a stray attribute set by a handler is an error, not a silent no-op; a
    middleware may still key a WeakKeyDictionary by message."""
    msg = claimed(
        1, "q", b"", {}, 1, 0, CLAIMED, DUE, None, None, uuid.uuid4(), CLAIMED, None, 0.0,
        1.0, CLAIMED.timestamp(), None,
    )  # fmt: skip
    assert not hasattr(msg, "__dict__")
    assert weakref.ref(msg)() is msg
    assert msg.due_epoch == DUE.timestamp()
