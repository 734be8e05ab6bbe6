"""How the arbiter tells of a worker's death, and how it ends itself after a bug of its own,
with no process forked: signals are recorded instead of sent, and a worker signalled is reaped
on the next turn.

A death's log line names the signal and its usual cause (SIGKILL: the OOM killer), as
gunicorn's does; an unexpected error in the arbiter's loop never escapes it: logged with its
traceback, the workers stopped at once, the metrics server closed, exit status 4.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import ClassVar

import pytest

from outbox_farm import Farm
from outbox_farm.prefork import arbiter as arbiter_module
from outbox_farm.prefork.arbiter import ARBITER_FAILED, Arbiter
from outbox_farm.prefork.child import BOOT_ERROR
from outbox_farm.prefork.deaths import describe_death
from outbox_farm.settings import SupervisorSettings
from tests.unit.test_arbiter_liveness import (
    arbiter,  # noqa: F401  (the fixture)
    sent,  # noqa: F401  (the fixture)
    worker,
)

# -- death hints -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (-9, "killed by signal 9 (SIGKILL): out of memory? see dmesg / the OOM killer"),
        (-11, "killed by signal 11 (SIGSEGV): a crash in native code"),
        (-7, "killed by signal 7 (SIGBUS): a crash in native code"),
        (-6, "killed by signal 6 (SIGABRT): aborted by native code"),
        (-15, "killed by signal 15 (SIGTERM): sent from outside the farm"),
        (-2, "killed by signal 2 (SIGINT): sent from outside the farm"),
        (1, "exit status 1: it crashed; its traceback is in the log above"),
        (BOOT_ERROR, f"exit status {BOOT_ERROR}: it could not boot"),
        (0, "exit status 0: it stopped although the arbiter did not ask it to"),
    ],
)
def test_a_death_names_its_signal_or_status_and_its_usual_cause(code: int, expected: str) -> None:
    assert describe_death(code).startswith(expected)


def test_a_death_without_a_known_cause_is_named_without_a_guess() -> None:
    assert describe_death(7) == "exit status 7"
    assert describe_death(-signal.SIGUSR1) == f"killed by signal {signal.SIGUSR1} (SIGUSR1)"
    assert describe_death(-200) == "killed by signal 200"  # no such signal here


def test_a_worker_killed_for_a_silent_heartbeat_is_not_blamed_on_memory() -> None:
    said = describe_death(-9, stale=True)
    assert said.startswith("killed by signal 9 (SIGKILL) by the arbiter: its heartbeat")
    assert "out of memory" not in said
    assert "out of memory" in describe_death(-9)  # positive control: not stale


def test_the_worker_died_line_carries_the_hint(
    arbiter: Arbiter,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    killed, _ = worker(arbiter, pid=4242, slot=0)
    crashed, _ = worker(arbiter, pid=4343, slot=1)
    with caplog.at_level(logging.WARNING, logger="outbox_farm.arbiter"):
        arbiter._died(arbiter.children.pop(killed.pid), booted=True, code=-signal.SIGKILL)
        arbiter._died(arbiter.children.pop(crashed.pid), booted=True, code=1)
    died = [r for r in caplog.records if getattr(r, "event", None) == "worker_died"]
    assert len(died) == 2
    said = [r.getMessage() for r in died]
    assert said[0].startswith(
        "worker 4242 (slot 0) died, killed by signal 9 (SIGKILL): out of memory? see dmesg"
    )
    assert said[1].startswith("worker 4343 (slot 1) died, exit status 1: it crashed")
    # The line's machine-readable field keeps its terse form.
    assert [getattr(r, "exit", None) for r in died] == ["signal SIGKILL", "status 1"]


# -- the arbiter's catch-all -----------------------------------------------------------------


class QuietWakeup:
    """Stands in for `Wakeup`: no signal handler installed in the test process, no sleeping;
    `pending` is what the test queues."""

    def __init__(self, signals: object) -> None:
        self.pending: list[int] = []

    def wait(self, timeout: float) -> None:
        pass


class Server:
    """Stands in for `Exposition` (the /metrics and /healthz process): what was done to it."""

    made: ClassVar[list[Server]] = []

    def __init__(self, bind: str, state_dir: Path) -> None:
        self.address, self.due, self.pid = bind, None, None
        self.started = self.closed = False
        Server.made.append(self)

    def start(self) -> None:
        self.started = True

    def publish(self, healthy: bool, detail: dict[str, object]) -> None:
        pass

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def supervised(
    tmp_path: Path,
    sent: list[tuple[int, int]],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> Arbiter:
    """An arbiter with two workers (pids 4242 and 4343) that die on the turn after they are
    signalled, a fake metrics server, and nothing else to do in a turn."""
    monkeypatch.setattr(arbiter_module, "Wakeup", QuietWakeup)
    monkeypatch.setattr(arbiter_module, "Exposition", Server)
    Server.made.clear()

    def reap(self: Arbiter) -> None:
        for pid, _ in sent:
            self.children.pop(pid, None)

    monkeypatch.setattr(Arbiter, "_reap", reap)
    monkeypatch.setattr(Arbiter, "_manage", lambda self: None)
    farm = Farm(table="outbox", dlq_table="outbox_dlq")
    settings = SupervisorSettings(procs=2, metrics_bind="127.0.0.1:0")
    supervisor = Arbiter(farm, "host=127.0.0.1 port=1", tmp_path, settings)
    worker(supervisor, pid=4242, slot=0)
    worker(supervisor, pid=4343, slot=1)
    return supervisor


def test_an_error_in_the_loop_stops_the_workers_at_once_and_exits_4(
    supervised: Arbiter,
    sent: list[tuple[int, int]],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(self: Arbiter) -> None:
        raise RuntimeError("a bug in the arbiter")

    monkeypatch.setattr(Arbiter, "_murder_stale", broken)
    with caplog.at_level(logging.INFO, logger="outbox_farm.arbiter"):
        assert supervised.run() == ARBITER_FAILED == 4
    assert sorted(sent) == [(4242, signal.SIGQUIT), (4343, signal.SIGQUIT)]
    assert supervised.children == {}
    [failed] = [r for r in caplog.records if getattr(r, "event", None) == "arbiter_failed"]
    assert failed.exc_info is not None
    assert str(failed.exc_info[1]) == "a bug in the arbiter"
    assert "exiting with status 4" in failed.getMessage()
    assert caplog.records[-1].event == "arbiter_stopped"  # type: ignore[attr-defined]
    [server] = Server.made
    assert server.started
    assert server.closed


def test_positive_control_a_term_drains_the_same_workers_and_exits_0(
    supervised: Arbiter,
    sent: list[tuple[int, int]],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        Arbiter, "_murder_stale", lambda self: self._wakeup.pending.append(signal.SIGTERM)
    )
    assert supervised.run() == 0
    assert sorted(sent) == [(4242, signal.SIGTERM), (4343, signal.SIGTERM)]
    [server] = Server.made
    assert server.closed
