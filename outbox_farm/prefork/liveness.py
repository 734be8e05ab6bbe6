"""The arbiter's judgement of its workers, from their heartbeat files: which are stuck, and
whether the farm is healthy.

Pure over the children and a monotonic `now` the arbiter passes in: no clock, signal or file
of its own, so each rule is tested on a clock the test moves.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterable

from ..fleet.member import ALL_DOWN
from .beats import Child
from .child import STACK_DUMP

log = logging.getLogger("outbox_farm.arbiter")
BOOT_TIMEOUT = 60.0  # seconds a worker may take to its first beat (it is importing the app)
STACK_DUMP_GRACE = 1.0  # seconds a stuck worker gets to write its stacks before SIGKILL


def judge(children: Iterable[Child], now: float, heartbeat_timeout: float) -> list[tuple[int, int]]:
    """The signals to send, as (pid, signal): a worker whose event loop stopped beating is
    killed in two steps, STACK_DUMP first so the log shows where it was stuck, then SIGKILL
    `STACK_DUMP_GRACE` later, on a later turn (the arbiter's loop never waits for it)."""
    signals: list[tuple[int, int]] = []
    for child in list(children):
        if child.kill_at is not None:
            if now >= child.kill_at:
                child.kill_at = None
                signals.append((child.pid, signal.SIGKILL))
            continue
        if child.stale:
            continue
        limit = heartbeat_timeout if child.beating() else BOOT_TIMEOUT
        silent = child.silent_for(now)
        if silent > limit:
            log.error(
                "worker %d sent no heartbeat for %.0fs (event loop blocked?); its Python "
                "stacks follow, then it is killed",
                child.pid,
                silent,
                extra={"event": "worker_stuck"},
            )
            child.stale = True
            child.kill_at = now + STACK_DUMP_GRACE
            signals.append((child.pid, STACK_DUMP))
    return signals


def health(
    active: Iterable[Child],
    procs: int,
    now: float,
    heartbeat_timeout: float,
    degraded: Iterable[str] = (),
) -> tuple[bool, dict[str, object]]:
    """Healthy when `procs` workers booted and beat, and none reports a problem (a worker
    waiting for its database reports that it cannot reach it); the detail /healthz shows.

    A fleet's process that serves only databases that are down is a problem only when every
    process is in that state (`ALL_DOWN`); until then it is listed as degraded.

    `degraded` (the arbiter's own notes) and the workers' warnings are listed under `degraded`
    and leave the farm healthy: each says the farm delivers, but not as deployed (the last
    reload failed; farms on this database run different code for a queue). A 503 would have
    an orchestrator restart or unroute processes that work, and a restarted farm would load
    the failing code for good.
    """
    judged = [c for c in active if not c.stale]
    live = [c for c in judged if c.booted() and c.silent_for(now) <= heartbeat_timeout]
    said = [c.problem() for c in judged]
    # A fleet's process whose databases are all down: the farm's problem only when every
    # process says so; otherwise the other databases flow, and those are degraded.
    down = [p for p in said if p and p.startswith(ALL_DOWN)]
    partly = down if len(down) < len(judged) else []
    problems = sorted({p for p in said if p and p not in partly})
    notes = sorted({*degraded, *partly, *(w for c in judged for w in c.warnings())})
    detail: dict[str, object] = {"procs": procs, "alive": len(live), "pid": os.getpid()}
    if problems:
        detail["problems"] = problems
    if notes:
        detail["degraded"] = notes
    return len(live) >= procs and not problems, detail
