"""The arbiter's judgement of its workers, with no process forked: heartbeats written by the
worker's own code (`Pulse`), read by the arbiter's (`Child`, `Arbiter`), under wall-clock steps
and on a clock the test moves.

Liveness must be judged on monotonic time: an NTP step or a resumed VM moves `time.time()` by
an hour, and neither a kill, nor an unhealthy /healthz, nor a crash booked as a boot failure
may follow from that.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from outbox_farm import Farm
from outbox_farm.prefork import arbiter as arbiter_module
from outbox_farm.prefork.arbiter import Arbiter
from outbox_farm.prefork.beats import Child, Pulse
from outbox_farm.prefork.child import BOOT_ERROR, STACK_DUMP
from outbox_farm.prefork.liveness import BOOT_TIMEOUT, STACK_DUMP_GRACE
from outbox_farm.prefork.restarts import MAX_BOOT_FAILURES
from outbox_farm.settings import SupervisorSettings

TIMEOUT = 30.0  # the farm's heartbeat timeout here


class Clock:
    """Stands in for the arbiter module's `time`: the real clocks, each moved by an offset."""

    def __init__(self) -> None:
        self.wall_step = 0.0
        self.elapsed = 0.0

    def time(self) -> float:
        return time.time() + self.wall_step

    def monotonic(self) -> float:
        return time.monotonic() + self.elapsed


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """The arbiter's clock; `time.time` is stepped for every module, as a real step would be."""
    fake = Clock()
    real_time = time.time
    monkeypatch.setattr(arbiter_module, "time", fake)
    monkeypatch.setattr(time, "time", lambda: real_time() + fake.wall_step)
    return fake


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The (pid, signal) pairs the arbiter sends, recorded instead of sent."""
    signals: list[tuple[int, int]] = []
    monkeypatch.setattr(Arbiter, "_kill", staticmethod(lambda pid, sig: signals.append((pid, sig))))
    return signals


@pytest.fixture
def arbiter(tmp_path: Path, sent: list[tuple[int, int]]) -> Arbiter:
    """An arbiter that never ran: no fork, no signal handler, no /metrics."""
    farm = Farm(table="outbox", dlq_table="outbox_dlq")
    settings = SupervisorSettings(procs=1, heartbeat_timeout=TIMEOUT, metrics_bind=None)
    return Arbiter(farm, "host=127.0.0.1 port=1", tmp_path, settings)


def worker(arbiter: Arbiter, pid: int = 4242, slot: int = 0) -> tuple[Child, Pulse]:
    """A child record as `_spawn` makes it, and the worker side of its heartbeat."""
    heartbeat, spawned_at = Child.new_heartbeat(arbiter.state_dir, slot)
    child = Child(pid, slot, worker_id=7, spawned_at=spawned_at, heartbeat=heartbeat)
    arbiter.children[pid] = child
    return child, Pulse(heartbeat, os.getppid(), asyncio.Event())


class Booted:
    """What `Pulse.booted` needs of a runtime."""

    problem: str | None = None
    warnings: tuple[str, ...] = ()


def booted(pulse: Pulse) -> None:
    pulse.booted(Booted())  # type: ignore[arg-type]


@pytest.mark.parametrize("step", [3600.0, -3600.0], ids=["+1h", "-1h"])
def test_a_wall_clock_step_kills_no_worker_and_keeps_the_farm_healthy(
    arbiter: Arbiter, clock: Clock, sent: list[tuple[int, int]], step: float
) -> None:
    child, pulse = worker(arbiter)
    booted(pulse)
    assert arbiter._health()[0], "positive control: healthy before the step"
    clock.wall_step = step
    pulse.beat()
    arbiter._murder_stale()
    assert sent == []
    healthy, detail = arbiter._health()
    assert healthy, detail
    assert detail["alive"] == 1
    assert child.booted()
    # Positive control: the same worker, silent past the timeout on the monotonic clock, is
    # judged stuck.
    clock.elapsed = TIMEOUT + 1
    arbiter._murder_stale()
    assert sent == [(child.pid, STACK_DUMP)]


def test_a_stuck_worker_is_asked_for_its_stacks_and_killed_a_moment_later(
    arbiter: Arbiter, clock: Clock, sent: list[tuple[int, int]]
) -> None:
    child, pulse = worker(arbiter)
    booted(pulse)
    clock.elapsed = TIMEOUT + 1
    arbiter._murder_stale()
    assert sent == [(child.pid, STACK_DUMP)]
    assert child.stale
    # The loop wakes in time for the kill, and does not kill before it.
    assert 0 < arbiter._next_turn() <= STACK_DUMP_GRACE
    clock.elapsed += STACK_DUMP_GRACE / 2
    arbiter._murder_stale()
    assert sent == [(child.pid, STACK_DUMP)]
    clock.elapsed += STACK_DUMP_GRACE
    arbiter._murder_stale()
    arbiter._murder_stale()
    assert sent == [(child.pid, STACK_DUMP), (child.pid, signal.SIGKILL)]


def test_a_worker_that_never_beat_gets_the_boot_timeout_not_the_heartbeat_timeout(
    arbiter: Arbiter, clock: Clock, sent: list[tuple[int, int]]
) -> None:
    child, _ = worker(arbiter)  # importing the app: no beat yet
    clock.elapsed = TIMEOUT + 1
    arbiter._murder_stale()
    assert sent == []
    clock.elapsed = BOOT_TIMEOUT + 1
    arbiter._murder_stale()
    assert sent == [(child.pid, STACK_DUMP)]


def test_a_worker_waiting_for_its_database_beats_and_is_reported_unready(
    arbiter: Arbiter, clock: Clock, sent: list[tuple[int, int]]
) -> None:
    child, pulse = worker(arbiter)
    pulse.unready = "database unreachable: connection refused"
    pulse.beat()
    assert child.beating()
    assert not child.booted()
    clock.elapsed = TIMEOUT - 1  # its last beat is that old: still in time
    arbiter._murder_stale()
    assert sent == []
    healthy, detail = arbiter._health()
    assert not healthy
    assert detail["alive"] == 0
    assert detail["problems"] == ["database unreachable: connection refused"]
    booted(pulse)  # the database is back
    healthy, detail = arbiter._health()
    assert healthy, detail
    assert "problems" not in detail


@pytest.mark.parametrize("code", [-signal.SIGKILL, -signal.SIGTERM, 1])
def test_workers_killed_before_they_booted_never_make_the_farm_give_up(
    arbiter: Arbiter, clock: Clock, code: int
) -> None:
    for pid in range(100, 100 + 2 * MAX_BOOT_FAILURES):
        child, pulse = worker(arbiter, pid)
        pulse.unready = "database unreachable: connection refused"
        pulse.beat()
        arbiter._died(arbiter.children.pop(pid), child.booted(), code)
        clock.elapsed += 60  # past any backoff
    assert not arbiter._backoff.given_up
    assert arbiter._backoff.boot_failures == 0


def test_workers_that_cannot_boot_make_the_farm_give_up(arbiter: Arbiter, clock: Clock) -> None:
    for pid in range(100, 100 + MAX_BOOT_FAILURES):
        assert not arbiter._backoff.given_up
        child, _ = worker(arbiter, pid)
        arbiter._died(arbiter.children.pop(pid), child.booted(), BOOT_ERROR)
        clock.elapsed += 60
    assert arbiter._backoff.given_up


def test_a_crash_after_a_wall_clock_step_back_is_still_a_crash(
    arbiter: Arbiter, clock: Clock
) -> None:
    clock.wall_step = -600.0
    for pid in range(100, 100 + MAX_BOOT_FAILURES):
        child, pulse = worker(arbiter, pid)
        booted(pulse)
        assert child.booted()
        arbiter._died(arbiter.children.pop(pid), child.booted(), -signal.SIGKILL)
    assert arbiter._backoff.boot_failures == 0
    assert not arbiter._backoff.given_up
