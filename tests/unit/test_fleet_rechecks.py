"""A worker's requests to read its fleet's set again (`prefork.rechecks`): one that arrives
while the worker boots is kept and passed on once, then every request goes straight through;
and the signal is ignored in a freshly forked process until its event loop takes it."""

from __future__ import annotations

import os
import signal

from outbox_farm.prefork.child import FORK_BLOCKED, STACK_DUMP, forked
from outbox_farm.prefork.rechecks import RECHECK, Rechecks


def test_a_request_while_booting_is_passed_on_once_served() -> None:
    calls: list[str] = []
    rechecks = Rechecks()
    rechecks.ask()
    rechecks.ask()
    assert calls == []
    assert rechecks.asked
    rechecks.attach(lambda: calls.append("recheck"))
    assert calls == ["recheck"]
    assert not rechecks.asked
    rechecks.ask()
    assert calls == ["recheck", "recheck"]


def test_nothing_asked_nothing_passed_on() -> None:
    calls: list[str] = []
    Rechecks().attach(lambda: calls.append("recheck"))
    assert calls == []


def test_the_signal_is_its_own_and_survives_a_fresh_fork() -> None:
    assert RECHECK not in (STACK_DUMP, signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
    assert RECHECK in FORK_BLOCKED
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's verdict is its exit status
        try:
            forked("recheck-test")
            os.kill(os.getpid(), RECHECK)  # ignored: the process lives on
            os._exit(0 if signal.getsignal(RECHECK) == signal.SIG_IGN else 2)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
