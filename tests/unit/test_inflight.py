"""The in-flight ledger's claims: a claim's token is `held` (a claim must not take its rows
again) exactly while one of its rows is still in hand."""

from __future__ import annotations

import uuid

from outbox_farm.observe import Observer
from outbox_farm.worker.inflight import Ledger


def test_a_claims_token_is_held_until_its_last_row_is_settled() -> None:
    ledger = Ledger("q", 10, Observer())
    first, second = uuid.uuid4(), uuid.uuid4()
    ledger.hold([1, 2], first)
    ledger.hold([3], second)
    assert ledger.held() == [first, second]
    ledger.settle(1, first)
    assert ledger.held() == [first, second]
    ledger.settle_all([(2, uuid.UUID(str(first))), (3, second)])  # an equal token settles too
    assert ledger.held() == []
    assert len(ledger) == 0


def test_a_row_claimed_again_moves_to_its_new_claim() -> None:
    """Its retry was written and it was claimed again before the write's reply was read: the
    old claim no longer holds it, and the old settlement leaves the new claim alone."""
    ledger = Ledger("q", 10, Observer())
    old, new = uuid.uuid4(), uuid.uuid4()
    ledger.hold([7], old)
    ledger.hold([7], new)
    assert ledger.held() == [new]
    ledger.settle(7, old)  # the late reply of the old write
    assert ledger.held() == [new]
    assert len(ledger) == 1
    ledger.settle(7, new)
    assert ledger.held() == []


def test_a_row_the_heartbeat_found_lost_is_settled_with_its_claim() -> None:
    ledger = Ledger("q", 10, Observer())
    token = uuid.uuid4()
    ledger.hold([4, 5], token)
    ledger.start(4)
    ledger.extended([4], [token], matched=set())  # the heartbeat matched nothing: lost
    assert ledger.finish(4, token) is False  # settled here, unwritten
    assert ledger.held() == [token]  # row 5 is still in hand
    assert ledger.finish(5, token) is True
    ledger.settle(5, token)
    assert ledger.held() == []
