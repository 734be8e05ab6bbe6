"""The arbiter: forks N worker processes and keeps them alive (prefork, like gunicorn's).

Signal handlers only queue the signal and poke a self-pipe; one main loop wakes at least once a
second and, in order: handles queued signals (each through its `handle_<name>` method), reaps
dead children, kills children whose heartbeat went stale, spawns or retires children until the
target count runs, and publishes its health for /healthz. Nothing in a turn waits on anyone:
/metrics and /healthz are served by a process of their own (`exposition`), rows are handed back
by short-lived processes (`handback`), and liveness is read from files. The arbiter holds no
event loop, thread or database connection when it forks. Every time is monotonic: a step of the
wall clock (NTP, a resumed VM) changes nothing here.

A worker that died for any reason but a failed boot is a crash: it is replaced at once and, if
it had booted, the rows it held are handed back at once; when to fork again, and when to give
up because workers cannot boot (exit status 3 instead of fork-looping), is `restarts`'
decision. A worker waiting for an unreachable database is not failing to boot: it stays, beats
and reports itself unready.

What each signal asks for, a fleet's HUP among them, is decided in `signals`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigurationError
from ..fleet.fleet import Fleet
from ..metrics import supervisor_metrics
from ..settings import SupervisorSettings
from ..worker.runtime import PAST_DEADLINE
from . import liveness
from .app import App, AppLoader
from .beats import Child
from .child import ARBITER_SIGNALS, BOOT_ERROR, FORK_BLOCKED, describe_exit, run_child
from .deaths import describe_death
from .exposition import Exposition
from .handback import HandBacks
from .reloader import Rollout, SourceWatcher
from .restarts import GIVING_UP, RestartBackoff
from .signals import SignalHandlers
from .wakeup import Wakeup

log = logging.getLogger("outbox_farm.arbiter")
GAUGES_INTERVAL = 5.0  # seconds between the housekeeper's refreshes of the database gauges
# Seconds a draining worker may take past its graceful deadline: its stop's longest overrun
# (`runtime.PAST_DEADLINE`, a flush the database still answers) and a second to exit.
PAST_GRACEFUL = PAST_DEADLINE + 1.0
STOP_AT_ONCE = 5.0  # seconds an immediate stop waits before it kills
TURN = 1.0  # the longest the loop sleeps when no signal wakes it
HANDBACK_AT_EXIT = 2.0  # seconds the arbiter's exit waits for hand-backs still under way
ARBITER_FAILED = 4  # exit status after an unexpected error in the arbiter's own loop


@dataclass
class Arbiter(SignalHandlers):
    """Supervises the worker processes running `farm` against `dsn`, as `settings` say.

    With a `loader` and without `settings.preload`, each child imports the app afresh after
    the fork; `settings.reload` needs the loader, to know the app's files. Everything here is
    owned by the one arbiter thread; signal handlers only queue the signal (`Wakeup`).
    """

    farm: App
    dsn: str
    state_dir: Path  # heartbeat and problem files of the children
    settings: SupervisorSettings
    loader: AppLoader | None = None
    procs: int = field(init=False)  # the target count: settings.procs, then TTIN / TTOU
    children: dict[int, Child] = field(init=False, default_factory=dict)
    _backoff: RestartBackoff = field(init=False, default_factory=RestartBackoff)
    _rollout: Rollout = field(init=False)  # HUP, --reload
    _watcher: SourceWatcher | None = field(init=False, default=None)  # --reload, a fleet's HUP
    _stopping: bool | None = field(init=False, default=None)  # True graceful, False immediate
    _exposition: Exposition | None = field(init=False, default=None)
    _handbacks: HandBacks = field(init=False, default_factory=HandBacks)
    _wakeup: Wakeup = field(init=False)  # from `run` on

    def __post_init__(self) -> None:
        if self.settings.reload and self.loader is None:
            raise ConfigurationError("reload needs the app's loader, to know which files to watch")
        self.procs = self.settings.procs
        self._rollout = Rollout(self.state_dir)

    def run(self) -> int:
        """Supervise until told to stop; the process exit status.

        An unexpected error in the loop ends it as in gunicorn: logged with its traceback, the
        workers stopped at once rather than drained (a drain runs the loop's code that just
        raised, for up to the graceful deadline; their rows come back by hand-back or lease
        expiry), the metrics server closed, exit status `ARBITER_FAILED`."""
        supervisor_metrics()  # made here, after the multiprocess directory was set
        bind = self.settings.metrics_bind
        self._exposition = Exposition(bind, self.state_dir) if bind else None
        self._wakeup = Wakeup(ARBITER_SIGNALS)
        if self.loader is not None and (self.settings.reload or self._fleet_code_may_change):
            self._watcher = SourceWatcher(self.loader)
        bound = self._exposition.address if self._exposition is not None else "(off)"
        log.info(
            "arbiter started: %d processes, metrics on %s%s",
            self.procs,
            bound,
            ", reloading on code changes" if self.settings.reload else "",
            extra={"event": "arbiter_started", "metrics_bind": bound},
        )
        try:
            if self._exposition is not None:
                self._publish()  # before the server's first answer: "starting", not "no news"
                self._exposition.start()
            return self._loop()
        except Exception:
            log.exception(
                "the arbiter failed unexpectedly (a bug: report it with this traceback); "
                "stopping the workers at once, then exiting with status %d",
                ARBITER_FAILED,
                extra={"event": "arbiter_failed"},
            )
            self._stop(graceful=False)  # should this raise too, each worker exits by itself
            return ARBITER_FAILED
        finally:
            if self._exposition is not None:
                self._exposition.close()

    def _wait(self, timeout: float) -> None:
        """Sleep until a signal or `timeout`, then publish the health: every turn of every loop
        passes here, so /healthz is never older than one turn."""
        self._wakeup.wait(timeout)
        self._publish()

    def _publish(self) -> None:
        if self._exposition is not None:
            self._exposition.publish(*self._health())

    def _next_turn(self) -> float:
        """Seconds until something is due: a stuck worker's SIGKILL, or at most `TURN`."""
        now = time.monotonic()
        due = [c.kill_at - now for c in self.children.values() if c.kill_at is not None]
        if self._exposition is not None and self._exposition.due is not None:
            due.append(self._exposition.due - now)
        return max(min([TURN, *due]), 0.0)

    def _loop(self) -> int:
        while True:
            self._wait(self._next_turn())
            while self._wakeup.pending and self._stopping is None:
                self.handle(self._wakeup.pending.pop(0))
            if self._stopping is not None:
                return self._stop(graceful=self._stopping)
            self._reap()
            if self._backoff.given_up:
                log.error(GIVING_UP, self._backoff.boot_failures, extra={"event": "halt"})
                self._stop(graceful=False)
                return BOOT_ERROR
            self._murder_stale()
            self._handbacks.end_overdue(self._kill)
            self._watch_sources()
            self._manage()

    # -- children ------------------------------------------------------------------------

    def _active(self) -> list[Child]:
        return [c for c in self.children.values() if not c.retiring]

    def _fork(self) -> int:
        """`os.fork`, with the arbiter's signals blocked across it; in the new process (0 is
        returned there) the arbiter's descriptors are closed and `forked` must follow."""
        signal.pthread_sigmask(signal.SIG_BLOCK, FORK_BLOCKED)
        pid = os.fork()
        if pid == 0:
            if self._exposition is not None:
                self._exposition.close_in_worker()
            self._wakeup.close()
            return 0
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORK_BLOCKED)
        return pid

    def _spawn(self, slot: int) -> None:
        heartbeat, spawned_at = Child.new_heartbeat(self.state_dir, slot)
        worker_id = int.from_bytes(os.urandom(4), "big") & 0x7FFFFFFF
        # One process of the farm is the housekeeper: it alone refreshes the database-derived
        # gauges, vacuums the table and prunes the DLQ. In a fleet, every process is, of the
        # databases it holds (each has one holder unless the fleet says more copies).
        fleet = isinstance(self.farm, Fleet)
        settings = self.settings.runtime.for_worker(
            worker_id, housekeeper=fleet or slot == 0, gauges_interval=GAUGES_INTERVAL
        )
        loader = None if self.settings.preload else self.loader
        pid = self._fork()
        if pid == 0:
            run_child(self.farm, loader, self.dsn, heartbeat, settings)
        self.children[pid] = Child(pid, slot, worker_id, spawned_at, heartbeat)
        supervisor_metrics().processes.set(len(self.children))

    def _retire(self, child: Child, sig: int = signal.SIGTERM) -> None:
        child.retiring = True
        self._kill(child.pid, sig)

    @staticmethod
    def _kill(pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    def _reap(self) -> None:
        from prometheus_client import multiprocess

        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = os.waitstatus_to_exitcode(status)
            if self._exposition is not None and pid == self._exposition.pid:
                self._exposition.died(describe_exit(code))
                continue
            if self._handbacks.reaped(pid):
                continue
            child = self.children.pop(pid, None)
            if child is None:
                continue
            multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]
            supervisor_metrics().processes.set(len(self.children))
            # Before the worker's files go: they are the evidence (and its last words).
            booted, last_words = child.booted(), child.problem()
            child.forget()
            if code != 0 and booted:  # one that never booted took no lease
                self._handbacks.launch(self._fork, self.dsn, self.farm, child.worker_id, child.pid)
            if not child.retiring:
                self._died(child, booted, code, last_words)

    def _died(self, child: Child, booted: bool, code: int, last_words: str | None = None) -> None:
        """Account for a child that died without being told to, and schedule its successor.

        Only a child that says it cannot boot (`BOOT_ERROR`) is a boot failure: one killed or
        crashed before it booted (by the OOM killer, or while waiting for its database) is a
        crash, which never makes the farm give up.
        """
        how = describe_exit(code)
        if not booted and self._rollout.replacing(child.slot, self.children):
            # A HUP's replacement that cannot boot (a broken deploy): keep the running workers
            # on the old code rather than trading them for ones that cannot start.
            reason = "boot"
            self._rollout.abandon(last_words or how)
            log.error(
                "new worker %d failed to boot (%s: %s); rolling restart abandoned, the running "
                "workers keep the code they have, which is not the code on disk: /healthz says "
                "so until a reload succeeds",
                child.pid,
                how,
                last_words or "see its log lines above",
                extra={"event": "rolling_restart_failed", "exit": how},
            )
        elif code == BOOT_ERROR:
            reason = "boot"
            delay = self._backoff.boot_failed(time.monotonic())
            log.warning(
                "worker %d failed to boot (%s); retrying in %.1fs",
                child.pid,
                how,
                delay,
                extra={"event": "boot_failed", "exit": how},
            )
        else:
            reason = "heartbeat" if child.stale else "crash"
            delay = self._backoff.crashed(child.slot, time.monotonic())
            log.warning(
                "worker %d (slot %d) died%s, %s; %s",
                child.pid,
                child.slot,
                "" if booted else " before it started",
                describe_death(code, stale=child.stale),
                f"replacing it in {delay:.1f}s" if delay else "replacing it",
                extra={"event": "worker_died", "reason": reason, "exit": how, "slot": child.slot},
            )
        supervisor_metrics().worker_restarts.labels(reason).inc()

    def _murder_stale(self) -> None:
        for pid, sig in liveness.judge(
            self.children.values(), time.monotonic(), self.settings.heartbeat_timeout
        ):
            self._kill(pid, sig)

    def _watch_sources(self) -> None:
        if self._watcher is None or not self.settings.reload or self._rollout.pending:
            return
        changed = self._watcher.changes()
        if changed is not None:
            log.info(
                "code changed (%s); replacing every worker", changed, extra={"event": "reload"}
            )
            self._rollout.begin(c.pid for c in self._active())

    def _manage(self) -> None:
        active = self._active()
        if self._rollout.pending:
            self._rollout.step(self.children, active, self._spawn, self._retire)
            return
        if len(active) > self.procs:
            for child in sorted(active, key=lambda c: c.slot)[self.procs :]:
                self._retire(child)
            return
        if len(active) < self.procs:
            now = time.monotonic()
            used = {c.slot for c in active}
            for slot in range(self.procs):
                if slot not in used and self._backoff.may_spawn(slot, now):
                    self._spawn(slot)

    def _health(self) -> tuple[bool, dict[str, object]]:
        return liveness.health(
            self._active(),
            self.procs,
            time.monotonic(),
            self.settings.heartbeat_timeout,
            self._rollout.degraded(),
        )

    def _stop(self, *, graceful: bool) -> int:
        sig = signal.SIGTERM if graceful else signal.SIGQUIT
        log.info(
            "stopping %d children (%s)",
            len(self.children),
            "graceful" if graceful else "immediate",
            extra={"event": "arbiter_stopping"},
        )
        for child in self.children.values():
            self._retire(child, sig)
        wait = self.settings.graceful_timeout + PAST_GRACEFUL if graceful else STOP_AT_ONCE
        deadline = time.monotonic() + wait
        while self.children and time.monotonic() < deadline:
            self._wait(0.1)
            stops = {signal.SIGQUIT, signal.SIGTERM, signal.SIGINT}
            if graceful and stops & set(self._wakeup.pending):
                log.info(
                    "second stop signal: stopping at once", extra={"event": "arbiter_stopping"}
                )
                graceful = False
                deadline = min(deadline, time.monotonic() + STOP_AT_ONCE)
                for child in self.children.values():
                    self._kill(child.pid, signal.SIGQUIT)
            self._wakeup.pending.clear()
            self._reap()
            self._handbacks.end_overdue(self._kill)
        killed = list(self.children)
        for pid in killed:
            log.error(
                "worker %d did not stop in time; killing it", pid, extra={"event": "worker_killed"}
            )
            self._kill(pid, signal.SIGKILL)
        # The killed workers' rows are handed back as after any crash; that gets a short
        # deadline of its own, as nothing is lost without it (the leases expire).
        deadline = time.monotonic() + HANDBACK_AT_EXIT
        while (self.children or self._handbacks.running) and time.monotonic() < deadline:
            self._wait(0.05)
            self._wakeup.pending.clear()
            self._reap()
        for pid in [*self.children, *self._handbacks.running]:
            self._kill(pid, signal.SIGKILL)
        supervisor_metrics().processes.set(0)
        log.info("arbiter stopped", extra={"event": "arbiter_stopped"})
        return 1 if killed else 0
