"""`db.claims.message_maker`, the one place a claimed row becomes a `Message`, against the
dataclass's own constructor: the same message, every slot set, the columns found by name."""

from __future__ import annotations

import dataclasses
import uuid
import weakref
from datetime import UTC, datetime, timedelta

import pytest

from outbox_farm.db.claims import CLAIMED_COLUMNS, Undecodable, message_maker
from outbox_farm.message import Message
from outbox_farm.storage import Claim

CLAIMED = datetime(2026, 11, 27, 12, 0, 0, 123456, tzinfo=UTC)
DUE = CLAIMED - timedelta(seconds=3.5)
TOKEN = uuid.uuid4()
CLAIM = Claim("orders", 10, 30.0, TOKEN, sent=99.0, start_by=130.5)
ROW = {
    "id": 42,
    "payload": b'{"n": 1}',
    "headers": {"content-type": "application/json"},
    "deliveries_count": 3,
    "attempts_count": 2,
    "created_at": CLAIMED - timedelta(hours=1),
    "next_attempt_at": DUE,
    "first_attempt_at": CLAIMED - timedelta(minutes=5),
    "timer_id": "t-1",
    "acquired_at": CLAIMED,
    "ordering_key": "customer-7",
    "unloadable": None,
}


def expected(**changes: object) -> Message:
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
        "lease_token": TOKEN,
        "claimed_at": CLAIMED,
        "ordering_key": "customer-7",
        "received_monotonic": 100.25,
        "start_by": 130.5,
        "claimed_epoch": CLAIMED.timestamp(),
        "due_epoch": DUE.timestamp(),
        "invalid": None,
        **changes,
    }
    return Message(**values)  # type: ignore[arg-type]


def assert_same(fast: Message, slow: Message) -> None:
    for field in dataclasses.fields(Message):
        assert getattr(fast, field.name) == getattr(slow, field.name), field.name


def test_a_claimed_row_is_the_message_the_constructor_builds() -> None:
    fast = message_maker(CLAIMED_COLUMNS, CLAIM, 100.25)(tuple(ROW.values()))
    assert_same(fast, expected())
    assert (fast.decision, fast.nack_delay, fast.error) == (None, None, None)
    assert fast.lease_token is TOKEN  # the claim's own object: the ledger finds it by identity
    assert set(Message.__slots__) - {"__weakref__"} == {f.name for f in dataclasses.fields(Message)}


def test_the_columns_are_found_by_name_in_any_order() -> None:
    names = tuple(reversed(CLAIMED_COLUMNS))
    fast = message_maker(names, CLAIM, 100.25)(tuple(ROW[name] for name in names))
    assert_same(fast, expected())


def test_a_missing_column_is_refused_at_once() -> None:
    with pytest.raises(RuntimeError, match="unloadable"):
        message_maker(CLAIMED_COLUMNS[:-1], CLAIM, 0.0)


def test_an_unloadable_row_is_a_message_with_stand_ins_and_its_reasons() -> None:
    headers = Undecodable("[1]")
    headers.why = "headers: a JSON array, not an object"
    row = {
        **ROW,
        "created_at": None,
        "next_attempt_at": None,
        "headers": headers,
        "unloadable": "created_at=infinity; next_attempt_at=10000-01-01",
    }
    fast = message_maker(CLAIMED_COLUMNS, CLAIM, 100.25)(tuple(row.values()))
    invalid = (
        "created_at: infinity is not a finite timestamp; next_attempt_at: 10000-01-01 is "
        "outside the years 1 to 9999; headers: a JSON array, not an object"
    )
    stand_ins = {"created_at": CLAIMED, "next_attempt_at": CLAIMED, "headers": {}}
    assert_same(fast, expected(**stand_ins, due_epoch=CLAIMED.timestamp(), invalid=invalid))


def test_a_message_has_no_instance_dict_and_takes_a_weak_reference() -> None:
    """Slots only: a stray attribute set by a handler is an error, not a silent no-op; a
    middleware may still key a WeakKeyDictionary by message."""
    msg = message_maker(CLAIMED_COLUMNS, CLAIM, 0.0)(tuple(ROW.values()))
    assert not hasattr(msg, "__dict__")
    assert weakref.ref(msg)() is msg
