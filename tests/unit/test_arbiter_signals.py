"""What each signal asks of the arbiter, with no process forked and no signal sent: the handlers
run as the main loop runs them (`handle`), the workers' signals are recorded instead of sent.

A HUP rolls a farm's workers out; a fleet's HUP first has every worker read its set again, and
rolls them out only when the running code is not the code on disk (files changed, or the last
roll failed), never with --preload.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import logging
import signal
from pathlib import Path

import pytest

from outbox_farm import Farm, Message
from outbox_farm.fleet import Fleet
from outbox_farm.prefork import signals as signals_module
from outbox_farm.prefork.arbiter import Arbiter
from outbox_farm.prefork.rechecks import RECHECK
from outbox_farm.settings import SupervisorSettings
from tests.unit.test_arbiter_liveness import (
    arbiter,  # noqa: F401  (the fixture)
    sent,  # noqa: F401  (the fixture)
    worker,
)


class Watcher:
    """Stands in for the `SourceWatcher` of the app's files: the change it reports, if any."""

    def __init__(self, changed: str | None) -> None:
        self.changed = changed
        self.looked = 0

    def changes(self) -> str | None:
        self.looked += 1
        return self.changed


def fleet_arbiter(tmp_path: Path, *, preload: bool, changed: str | None) -> Arbiter:
    """An arbiter of a fleet that never ran, with two workers (pids 4242, 4343) and a third
    (4444) already retiring."""
    farm = Farm()

    @farm.handler("work")
    async def work(msg: Message) -> None:
        pass

    fleet = Fleet(farm, databases=tmp_path / "set.toml")
    settings = SupervisorSettings(procs=2, metrics_bind=None, preload=preload)
    supervisor = Arbiter(fleet, "host=127.0.0.1 port=1", tmp_path, settings)
    supervisor._watcher = Watcher(changed)  # type: ignore[assignment]
    worker(supervisor, pid=4242, slot=0)
    worker(supervisor, pid=4343, slot=1)
    retiring, _ = worker(supervisor, pid=4444, slot=2)
    retiring.retiring = True
    return supervisor


def test_ttin_and_ttou_move_the_target_count_never_below_one(
    arbiter: Arbiter,  # noqa: F811
) -> None:
    assert arbiter.procs == 1
    arbiter.handle(signal.SIGTTIN)
    arbiter.handle(signal.SIGTTIN)
    assert arbiter.procs == 3
    for _ in range(4):
        arbiter.handle(signal.SIGTTOU)
    assert arbiter.procs == 1


@pytest.mark.parametrize(
    ("sig", "graceful"),
    [(signal.SIGTERM, True), (signal.SIGINT, True), (signal.SIGQUIT, False)],
    ids=["TERM", "INT", "QUIT"],
)
def test_term_and_int_ask_for_a_drain_and_quit_for_a_stop_at_once(
    arbiter: Arbiter,  # noqa: F811
    sig: signal.Signals,
    graceful: bool,
) -> None:
    assert arbiter._stopping is None
    arbiter.handle(sig)
    assert arbiter._stopping is graceful


def test_a_signal_without_a_handler_changes_nothing(
    arbiter: Arbiter,  # noqa: F811
    sent: list[tuple[int, int]],  # noqa: F811
) -> None:
    worker(arbiter)
    arbiter.handle(signal.SIGUSR1)
    assert (arbiter.procs, arbiter._stopping, arbiter._rollout.pending, sent) == (1, None, [], [])


def test_a_farms_hup_rolls_out_every_worker_not_already_retiring(
    arbiter: Arbiter,  # noqa: F811
    sent: list[tuple[int, int]],  # noqa: F811
) -> None:
    worker(arbiter, pid=4242, slot=0)
    retiring, _ = worker(arbiter, pid=4343, slot=1)
    retiring.retiring = True
    arbiter.handle(signal.SIGHUP)
    assert arbiter._rollout.pending == [4242]
    assert sent == []  # the roll's steps signal the workers, one at a time


def test_a_fleets_hup_without_new_code_has_every_worker_read_its_set_and_restarts_none(
    tmp_path: Path,
    sent: list[tuple[int, int]],  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    supervisor = fleet_arbiter(tmp_path, preload=False, changed=None)
    with caplog.at_level(logging.INFO, logger="outbox_farm.arbiter"):
        supervisor.handle(signal.SIGHUP)
    assert sent == [(4242, RECHECK), (4343, RECHECK)]
    assert supervisor._rollout.pending == []
    [line] = [r for r in caplog.records if getattr(r, "event", None) == "fleet_reread"]
    assert "no code changed" in line.getMessage()


def test_a_fleets_hup_after_a_code_change_rolls_the_workers_out_too(
    tmp_path: Path,
    sent: list[tuple[int, int]],  # noqa: F811
) -> None:
    supervisor = fleet_arbiter(tmp_path, preload=False, changed="app.py")
    supervisor.handle(signal.SIGHUP)
    assert sent == [(4242, RECHECK), (4343, RECHECK)]
    assert supervisor._rollout.pending == [4242, 4343]


def test_a_fleets_hup_after_a_failed_roll_rolls_the_workers_out_with_no_file_changed(
    tmp_path: Path,
    sent: list[tuple[int, int]],  # noqa: F811
) -> None:
    supervisor = fleet_arbiter(tmp_path, preload=False, changed=None)
    supervisor._rollout.failed = "ImportError: no module named app"
    supervisor.handle(signal.SIGHUP)
    assert supervisor._rollout.pending == [4242, 4343]


def test_a_preloaded_fleets_hup_never_rolls_the_workers_out(
    tmp_path: Path,
    sent: list[tuple[int, int]],  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    supervisor = fleet_arbiter(tmp_path, preload=True, changed="app.py")
    with caplog.at_level(logging.INFO, logger="outbox_farm.arbiter"):
        supervisor.handle(signal.SIGHUP)
    assert sent == [(4242, RECHECK), (4343, RECHECK)]
    assert supervisor._rollout.pending == []
    assert supervisor._watcher.looked == 0  # type: ignore[union-attr]
    [line] = [r for r in caplog.records if getattr(r, "event", None) == "fleet_reread"]
    assert "--preload" in line.getMessage()


def test_every_name_the_handlers_declare_for_the_type_checker_is_the_arbiters() -> None:
    """The handlers' view of the arbiter is declared for mypy only (`TYPE_CHECKING`), so mypy
    cannot see one the arbiter no longer has: a field or method of its, by name."""
    tree = ast.parse(inspect.getsource(signals_module.SignalHandlers))
    block = next(node for node in ast.walk(tree) if isinstance(node, ast.If))
    declared = {
        node.target.id if isinstance(node, ast.AnnAssign) else node.name
        for node in block.body
        if isinstance(node, ast.FunctionDef)
        or (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name))
    }
    assert {"farm", "_watcher", "_active", "_kill"} <= declared
    fields = {f.name for f in dataclasses.fields(Arbiter)}
    missing = {
        name
        for name in declared
        if name not in fields and name not in vars(Arbiter)  # not on the stub: it only types
    }
    assert not missing, missing
