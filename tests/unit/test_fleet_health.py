"""/healthz of a fleet: a process whose databases are all down is the farm's problem only
when every process is in that state; until then it is degraded, by name, and the farm stays
healthy (the other databases flow)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from outbox_farm.fleet.member import ALL_DOWN
from outbox_farm.prefork.beats import Child, Pulse
from outbox_farm.prefork.liveness import health


class Serving:
    def __init__(self, problem: str | None = None, warnings: tuple[str, ...] = ()) -> None:
        self.problem = problem
        self.warnings = list(warnings)


def booted(state: Path, slot: int, serving: Serving) -> Child:
    heartbeat, spawned_at = Child.new_heartbeat(state, slot)
    Pulse(heartbeat, os.getppid(), asyncio.Event()).booted(serving)
    return Child(4000 + slot, slot, worker_id=slot, spawned_at=spawned_at, heartbeat=heartbeat)


def test_one_process_with_every_database_down_is_degraded_not_failed(tmp_path: Path) -> None:
    down = Serving(f"{ALL_DOWN} (tenant_3: unreachable: connection refused)")
    fine = Serving(None, ("database tenant_9: unreachable: timeout",))
    children = [booted(tmp_path, 0, down), booted(tmp_path, 1, fine)]
    healthy, detail = health(children, 2, time.monotonic(), 30.0)
    assert healthy, detail
    assert "problems" not in detail
    assert detail["degraded"] == [
        "database tenant_9: unreachable: timeout",
        f"{ALL_DOWN} (tenant_3: unreachable: connection refused)",
    ]


def test_every_process_with_every_database_down_fails(tmp_path: Path) -> None:
    one = Serving(f"{ALL_DOWN} (tenant_1: unreachable: connection refused)")
    two = Serving(f"{ALL_DOWN} (tenant_2: unreachable: connection refused)")
    children = [booted(tmp_path, 0, one), booted(tmp_path, 1, two)]
    healthy, detail = health(children, 2, time.monotonic(), 30.0)
    assert not healthy
    assert detail["problems"] == [one.problem, two.problem]


def test_other_problems_of_a_process_still_fail_the_farm(tmp_path: Path) -> None:
    broken = Serving("home database unreachable: connection refused")
    fine = Serving()
    children = [booted(tmp_path, 0, broken), booted(tmp_path, 1, fine)]
    healthy, detail = health(children, 2, time.monotonic(), 30.0)
    assert not healthy
    assert detail["problems"] == ["home database unreachable: connection refused"]
