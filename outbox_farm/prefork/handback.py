"""Handing a dead worker's rows back to the queue at once, instead of when their leases expire.

The arbiter does this after it reaps a worker that booted and did not exit cleanly (one that
never booted took no lease). The arbiter itself must never wait on the database (an unreachable
one would hold up its signals, reaping and health reports for seconds per dead worker), so each
hand-back runs in a short-lived process the arbiter forks for it, with one connection of its
own, bounded by `RELEASE_TIMEOUT` and killed by the arbiter at `DEADLINE`. Best effort: a
hand-back that fails or is killed costs only time, as the leases expire anyway.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from typing import NoReturn

from ..db.fleet import leave_for
from ..db.leases import release_dead_worker
from ..dsn import redact
from ..errors import DatabaseError
from ..fleet.fleet import Fleet
from ..fleet.member import member_name
from .app import App
from .child import forked

log = logging.getLogger("outbox_farm.arbiter")
RELEASE_TIMEOUT = 5.0  # seconds for the connect, and then for the statement
DEADLINE = 2 * RELEASE_TIMEOUT + 1.0  # seconds after which the arbiter kills a hand-back
MAX_RUNNING = 8  # hand-backs under way at once; more means the database is not answering
HANDBACK_NAME = "outbox-handback"  # what ps and top show for a hand-back process


def hand_back(dsn: str, app: App, worker_id: int, pid: int) -> None:
    """Free the rows held by worker `worker_id` (process `pid`, for the log); of a fleet, give
    up the databases it held instead (its rows, in many databases, come back with their
    leases). Best effort: if the database cannot be reached, the leases still expire."""
    if isinstance(app, Fleet):
        try:
            leave_for(dsn, app.name, member_name(pid), RELEASE_TIMEOUT)
        except DatabaseError as exc:
            log.warning(
                "could not give up the databases of dead worker %d (%s); the others take them "
                "when its leases expire",
                pid,
                str(exc).strip(),
                extra={"event": "release_failed"},
            )
        return
    try:
        released = release_dead_worker(dsn, app.queries, worker_id, RELEASE_TIMEOUT)
    except DatabaseError as exc:
        log.warning(
            "could not hand back the rows of dead worker %d on %s (%s); they are delivered "
            "again when their leases expire",
            pid,
            redact(dsn),
            str(exc).strip(),
            extra={"event": "release_failed"},
        )
        return
    if released:
        log.info(
            "handed back %d rows held by dead worker %d",
            released,
            pid,
            extra={"event": "leases_released", "rows": released},
        )


def run_hand_back(dsn: str, app: App, worker_id: int, pid: int) -> NoReturn:
    """The hand-back process, right after the fork (signal handling already reset); never
    returns. Ctrl-C reaches the whole process group: the arbiter decides when this one ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = 0
    try:
        hand_back(dsn, app, worker_id, pid)
    except BaseException:
        log.exception("handing back the rows of dead worker %d failed", pid)
        code = 1
    finally:
        logging.shutdown()
    os._exit(code)


class HandBacks:
    """The hand-back processes under way, by pid, with the monotonic time each must be done
    by; written and read by the arbiter thread only."""

    def __init__(self) -> None:
        self.running: dict[int, float] = {}

    def launch(self, fork: Callable[[], int], dsn: str, app: App, worker_id: int, pid: int) -> None:
        """Free dead worker `pid`'s rows now, from a process `fork` makes (the arbiter's fork,
        its signals blocked across it); skipped, rows left to their leases, while MAX_RUNNING
        hand-backs are still under way."""
        if self.full():
            log.warning(
                "%d hand-backs are still under way (is the database answering?); the rows of "
                "dead worker %d are delivered again when their leases expire",
                len(self.running),
                pid,
                extra={"event": "release_skipped"},
            )
            return
        handback = fork()
        if handback == 0:
            forked(HANDBACK_NAME)
            run_hand_back(dsn, app, worker_id, pid)
        self.started(handback, time.monotonic())

    def end_overdue(self, kill: Callable[[int, int], None]) -> None:
        """SIGKILL the hand-backs past their deadline (they stay listed until reaped)."""
        for pid in self.overdue(time.monotonic()):
            log.warning(
                "a hand-back (process %d) is still waiting for the database; killing it: the "
                "rows it was to free are delivered again when their leases expire",
                pid,
                extra={"event": "release_failed"},
            )
            kill(pid, signal.SIGKILL)

    def full(self) -> bool:
        return len(self.running) >= MAX_RUNNING

    def started(self, pid: int, now: float) -> None:
        self.running[pid] = now + DEADLINE

    def reaped(self, pid: int) -> bool:
        """Whether `pid`, just reaped, was a hand-back (it is forgotten)."""
        return self.running.pop(pid, None) is not None

    def overdue(self, now: float) -> list[int]:
        """The hand-backs past their deadline, each returned once (the caller kills them; they
        stay listed until reaped)."""
        late = [pid for pid, deadline in self.running.items() if now >= deadline]
        for pid in late:
            self.running[pid] = float("inf")
        return late
