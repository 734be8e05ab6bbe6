"""A queue's breaker in the store, the same on both: failures counted in a row across every
caller, the threshold's failure opening it (and only that one saying so), a success resetting
the count, one probe's turn per interval, and a close that every runtime hears."""

from __future__ import annotations

from outbox_farm import Breaker
from outbox_farm.storage import is_control
from tests.contract.conftest import Outbox

BREAKER = Breaker(failures=3, probe_every=10.0)


async def test_the_thresholds_failure_opens_it_and_says_so(outbox: Outbox) -> None:
    store = outbox.store
    assert await store.breaker_failed("q", BREAKER, "refused", down=False) == (False, False)
    assert await store.breaker_failed("q", BREAKER, "refused", down=False) == (False, False)
    opening = await outbox.wakeups(
        lambda: store.breaker_failed("q", BREAKER, "refused 3", down=False)
    )
    assert [is_control(payload) for payload in opening] == [True]
    # Beside it, later failures are not counted, and are told it is open.
    assert await store.breaker_failed("q", BREAKER, "refused", down=False) == (False, True)
    control = (await store.controls())["q"]
    assert control.tripped is not None
    assert control.tripped.reason == "refused 3"
    assert 9.0 < control.tripped.probe_in <= 10.0
    assert control.failures == 3


async def test_a_success_starts_the_count_again(outbox: Outbox) -> None:
    store = outbox.store
    for _ in range(2):
        await store.breaker_failed("q", BREAKER, "refused", down=False)
    assert (await store.controls())["q"].failures == 2
    await store.breaker_reset("q")
    assert "q" not in await store.controls()
    for _ in range(2):
        assert (await store.breaker_failed("q", BREAKER, "refused", down=False))[1] is False


async def test_down_opens_it_at_once(outbox: Outbox) -> None:
    assert await outbox.store.breaker_failed("q", BREAKER, "down", down=True) == (True, True)
    assert await outbox.store.breaker_failed("other", BREAKER, "x", down=False) == (False, False)


async def test_one_probe_per_interval_then_a_close_every_runtime_hears(outbox: Outbox) -> None:
    store = outbox.store
    await store.breaker_failed("q", BREAKER, "down", down=True)
    assert await store.breaker_probe("q", 10.0) is False  # not before its first interval
    await outbox.later(10.5)
    assert await store.breaker_probe("q", 10.0) is True
    assert await store.breaker_probe("q", 10.0) is False  # another caller: not this interval
    closing = await outbox.wakeups(lambda: store.breaker_close("q"))
    assert [is_control(payload) for payload in closing] == [True]
    assert "q" not in await store.controls()
    assert await store.breaker_close("q") is False
    assert await store.breaker_probe("q", 10.0) is False  # closed: nothing to probe
