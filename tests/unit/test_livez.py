"""/livez answers for the arbiter alone: alive (still the server's parent) and its loop turning
(a fresh snapshot), whatever the health it published says. Rendered here from a snapshot the
real `Exposition.publish` writes, on a monotonic clock the test moves."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox_farm.prefork import exposition as exposition_module
from outbox_farm.prefork.exposition import (
    STALE_AFTER,
    Exposition,
    render_health,
    render_liveness,
)

UNREACHABLE = {"procs": 2, "alive": 0, "problems": ["database unreachable: Connection refused"]}


class Clock:
    """time.monotonic as the exposition module reads it, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(exposition_module.time, "monotonic", fake)
    return fake


@pytest.fixture
def exposition(tmp_path: Path) -> Iterator[Exposition]:
    """An Exposition on a free loopback port, its server not started: only its snapshot."""
    made = Exposition("127.0.0.1:0", tmp_path)
    yield made
    made.close()


# This test process stands in for the server process, so its parent stands in for the arbiter.
ARBITER = os.getppid()


def test_livez_is_200_while_healthz_is_503_for_a_database_outage(
    exposition: Exposition, clock: Clock
) -> None:
    exposition.publish(False, UNREACHABLE)
    clock.now += STALE_AFTER / 2
    assert render_health(exposition.snapshot)[0] == 503  # the control: the farm is unready
    assert render_liveness(exposition.snapshot, ARBITER) == (200, {"arbiter": ARBITER})


def test_livez_is_503_once_the_arbiter_s_loop_stops_turning(
    exposition: Exposition, clock: Clock
) -> None:
    exposition.publish(True, {"procs": 2, "alive": 2})
    clock.now += STALE_AFTER
    assert render_liveness(exposition.snapshot, ARBITER)[0] == 200  # at the limit, still live
    clock.now += 2.0
    status, body = render_liveness(exposition.snapshot, ARBITER)
    assert (status, body["problems"]) == (
        503,
        [f"arbiter not responding for {STALE_AFTER + 2:.0f}s"],
    )
    exposition.publish(True, {"procs": 2, "alive": 2})  # the loop turns again
    assert render_liveness(exposition.snapshot, ARBITER)[0] == 200


def test_livez_is_503_when_the_arbiter_is_not_this_server_s_parent(
    exposition: Exposition, clock: Clock
) -> None:
    exposition.publish(True, {"procs": 1, "alive": 1})
    assert render_liveness(exposition.snapshot, ARBITER)[0] == 200  # the control
    other = os.getpid()  # alive, but not the parent: an arbiter that died and left its pid
    status, body = render_liveness(exposition.snapshot, other)
    assert (status, body) == (503, {"arbiter": other, "problems": [f"arbiter {other} is gone"]})


def test_livez_is_503_without_a_snapshot(exposition: Exposition, clock: Clock) -> None:
    status, body = render_liveness(exposition.snapshot, ARBITER)
    assert (status, body["problems"]) == (503, ["the arbiter has not reported its health yet"])
    exposition.publish(True, {})
    assert render_liveness(exposition.snapshot, ARBITER)[0] == 200
