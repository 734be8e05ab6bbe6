"""The arbiter's restart bookkeeping, without processes: `RestartBackoff` is pure and takes the
monotonic time as an argument, so every schedule is checked at exact instants."""

from __future__ import annotations

from outbox_farm.prefork.restarts import MAX_BOOT_FAILURES, MAX_DELAY, QUICK_CRASH, RestartBackoff


def test_crashes_far_apart_are_replaced_at_once() -> None:
    backoff = RestartBackoff()
    for n in range(10):
        now = 100.0 + n * (QUICK_CRASH + 0.5)
        assert backoff.crashed(slot=0, now=now) == 0.0
        assert backoff.may_spawn(0, now)


def test_quick_crashes_back_off_doubling_to_the_cap_and_one_slow_crash_resets() -> None:
    backoff = RestartBackoff()
    now, delays = 50.0, []
    backoff.crashed(slot=3, now=now)
    for _ in range(8):
        now += QUICK_CRASH / 4
        delays.append(backoff.crashed(slot=3, now=now))
    assert delays[:3] == [0.5, 1.0, 2.0]
    assert delays == sorted(delays)
    assert delays[-1] == MAX_DELAY
    assert not backoff.may_spawn(3, now + MAX_DELAY - 0.01)
    assert backoff.may_spawn(3, now + MAX_DELAY)
    assert backoff.crashed(slot=3, now=now + 60) == 0.0  # quiet for a minute: forgiven


def test_boot_failures_hold_every_slot_and_give_up_after_the_limit() -> None:
    backoff = RestartBackoff()
    now = 10.0
    for n in range(1, MAX_BOOT_FAILURES):
        delay = backoff.boot_failed(now)
        assert delay == min(0.5 * 2 ** (n - 1), MAX_DELAY)
        assert not backoff.may_spawn(0, now)
        assert not backoff.may_spawn(7, now + delay - 0.001)
        assert backoff.may_spawn(7, now + delay)
        assert not backoff.given_up
        now += delay
    backoff.boot_failed(now)
    assert backoff.given_up


def test_a_crash_after_booting_clears_the_boot_failures() -> None:
    """A worker that booted and then crashed shows the app can start: the count starts over."""
    backoff = RestartBackoff()
    for _ in range(MAX_BOOT_FAILURES - 1):
        backoff.boot_failed(1.0)
    backoff.crashed(slot=0, now=20.0)
    assert backoff.boot_failures == 0
    for _ in range(MAX_BOOT_FAILURES - 1):
        backoff.boot_failed(30.0)
    assert not backoff.given_up
