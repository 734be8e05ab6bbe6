"""The rolling restart's record of a failed reload (`prefork.reloader.Rollout`), with no
process forked: the children are records whose heartbeat files the test writes through the
worker's own `Pulse`."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from prometheus_client import REGISTRY

from outbox_farm.metrics import supervisor_metrics
from outbox_farm.prefork.beats import Child, Pulse, reload_failure
from outbox_farm.prefork.reloader import Rollout


class Booted:
    """What `Pulse.booted` needs of a runtime."""

    problem: str | None = None
    warnings: tuple[str, ...] = ()


def child(state_dir: Path, pid: int, slot: int, booted: bool) -> Child:
    heartbeat, spawned_at = Child.new_heartbeat(state_dir, slot)
    if booted:
        Pulse(heartbeat, os.getppid(), asyncio.Event()).booted(Booted())  # type: ignore[arg-type]
    return Child(pid, slot, worker_id=pid, spawned_at=spawned_at, heartbeat=heartbeat)


def gauge() -> float | None:
    supervisor_metrics()  # registered on first use
    return REGISTRY.get_sample_value("outbox_farm_reload_failed")


def step_until_done(rollout: Rollout, children: dict[int, Child], new_booted: bool) -> list[int]:
    """Run the roll to its end, replacements booting as `new_booted` says; the retired pids."""
    retired: list[int] = []

    def spawn(slot: int) -> None:
        pid = 1000 + len(children)
        children[pid] = child(next(iter(children.values())).heartbeat.parent, pid, slot, new_booted)

    def retire(old: Child) -> None:
        old.retiring = True
        retired.append(old.pid)

    for _ in range(10):
        if not rollout.pending:
            break
        active = [c for c in children.values() if not c.retiring]
        rollout.step(children, active, spawn, retire)
    return retired


def test_a_failed_reload_is_kept_until_a_roll_completes(tmp_path: Path) -> None:
    children = {1: child(tmp_path, 1, 0, True), 2: child(tmp_path, 2, 1, True)}
    rollout = Rollout(tmp_path)
    rollout.begin(children)
    assert rollout.replacing(0, children)
    rollout.abandon("importing 'app' raised SyntaxError: invalid syntax")
    assert rollout.pending == []
    assert gauge() == 1
    assert reload_failure(tmp_path) == "importing 'app' raised SyntaxError: invalid syntax"
    (note,) = rollout.degraded()
    assert note.startswith("the running code is not the code on disk")
    assert "(importing 'app' raised SyntaxError: invalid syntax)" in note

    rollout.begin(children)
    assert step_until_done(rollout, children, new_booted=True) == [1, 2]
    assert rollout.failed is None
    assert rollout.degraded() == []
    assert gauge() == 0
    assert reload_failure(tmp_path) is None


def test_a_roll_whose_old_workers_died_proves_nothing_and_keeps_the_failure(
    tmp_path: Path,
) -> None:
    children = {1: child(tmp_path, 1, 0, True)}
    rollout = Rollout(tmp_path)
    rollout.abandon("boom")
    rollout.begin(children)
    del children[1]  # died before any replacement booted: nothing says the new code boots
    step_until_done(rollout, children, new_booted=True)
    assert rollout.pending == []
    assert rollout.failed == "boom"
    assert gauge() == 1


def test_a_state_directory_it_cannot_write_costs_doctor_the_line_not_the_arbiter(
    tmp_path: Path,
) -> None:
    gone = tmp_path / "removed"  # the state directory, removed under the arbiter
    children = {1: child(tmp_path, 1, 0, True)}
    rollout = Rollout(gone)
    rollout.begin(children)
    rollout.abandon("boom")  # writing the file fails: no exception escapes
    assert rollout.failed == "boom"
    assert gauge() == 1
    assert rollout.degraded()
    assert reload_failure(gone) is None

    rollout.begin(children)
    assert step_until_done(rollout, children, new_booted=True) == [1]
    assert rollout.failed is None
    assert gauge() == 0
