"""The arbiter: forks N worker processes and keeps them alive (prefork, like gunicorn's).

Signal handlers only queue the signal and poke a self-pipe; one main loop wakes at least once a
second and, in order: answers /metrics and /healthz, handles queued signals, reaps dead
children, kills children whose heartbeat went stale, and spawns or retires children until the
target count runs. The arbiter holds no event loop, thread or database connection when it forks.

Signals: TERM/INT graceful drain (children get TERM, then KILL at the deadline); QUIT immediate;
HUP rolling restart, one child at a time, each replacement booted before its predecessor is
told to drain; TTIN / TTOU one child more / less.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import exposition
from .child import ARBITER_SIGNALS, BOOT_ERROR, run_child
from .farm import Farm

log = logging.getLogger("outbox_farm.arbiter")
MAX_BOOT_FAILURES = 5
BOOT_TIMEOUT = 60.0


@dataclass
class Child:
    pid: int
    slot: int
    spawned_at: float
    heartbeat: Path
    retiring: bool = False  # told to drain (HUP, TTOU); not counted towards the target

    def booted(self) -> bool:
        try:
            return self.heartbeat.stat().st_mtime >= self.spawned_at
        except FileNotFoundError:
            return False

    def silent_for(self, now: float) -> float:
        try:
            return now - self.heartbeat.stat().st_mtime
        except FileNotFoundError:
            return now - self.spawned_at


@dataclass
class Arbiter:
    """Supervises `procs` children running `farm` against `dsn`.

    State: everything here is owned by the one arbiter thread; signal handlers only append to
    `_signals`.
    """

    farm: Farm
    dsn: str
    procs: int
    state_dir: Path
    runtime_options: dict[str, Any] = field(default_factory=dict)
    graceful_timeout: float = 30.0
    heartbeat_timeout: float = 30.0
    metrics_bind: str | None = "127.0.0.1:9464"
    children: dict[int, Child] = field(default_factory=dict)
    _signals: list[int] = field(default_factory=list)
    _boot_failures: int = 0
    _next_spawn_at: float = 0.0
    _rolling: list[int] = field(default_factory=list)  # pids awaiting a HUP replacement

    def run(self) -> int:
        """Supervise until told to stop; the process exit status."""
        from prometheus_client import Counter, Gauge

        self._processes = Gauge(
            "outbox_farm_processes", "Worker processes running.", multiprocess_mode="max"
        )
        self._restarts = Counter(
            "outbox_farm_process_restarts", "Worker processes replaced after dying."
        )
        self._pipe_r, self._pipe_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        for sig in ARBITER_SIGNALS:
            signal.signal(sig, self._on_signal)
        signal.set_wakeup_fd(self._pipe_w)
        self._http = exposition.listen(self.metrics_bind) if self.metrics_bind else None
        log.info(
            "arbiter started: %d processes, metrics on %s",
            self.procs,
            self.metrics_bind or "(off)",
            extra={"event": "arbiter_started"},
        )
        try:
            return self._loop()
        finally:
            if self._http is not None:
                self._http.close()

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signals.append(signum)

    def _wait(self, timeout: float) -> None:
        ready = [self._pipe_r] + ([self._http] if self._http else [])
        try:
            readable, _, _ = select.select(ready, [], [], timeout)
        except InterruptedError:
            return
        if self._pipe_r in readable:
            while True:
                try:
                    if not os.read(self._pipe_r, 512):
                        break
                except BlockingIOError:
                    break
        if self._http is not None and self._http in readable:
            exposition.serve_one(self._http, self._health)

    def _loop(self) -> int:
        while True:
            self._wait(1.0)
            while self._signals:
                signum = self._signals.pop(0)
                if signum in (signal.SIGTERM, signal.SIGINT):
                    return self._stop(graceful=True)
                if signum == signal.SIGQUIT:
                    return self._stop(graceful=False)
                if signum == signal.SIGHUP:
                    log.info(
                        "HUP: rolling restart of %d children",
                        len(self.children),
                        extra={"event": "rolling_restart"},
                    )
                    self._rolling = [c.pid for c in self.children.values() if not c.retiring]
                elif signum == signal.SIGTTIN:
                    self.procs += 1
                    log.info(
                        "TTIN: %d processes",
                        self.procs,
                        extra={"event": "scaled", "procs": self.procs},
                    )
                elif signum == signal.SIGTTOU and self.procs > 1:
                    self.procs -= 1
                    log.info(
                        "TTOU: %d processes",
                        self.procs,
                        extra={"event": "scaled", "procs": self.procs},
                    )
            self._reap()
            if self._boot_failures >= MAX_BOOT_FAILURES:
                log.error(
                    "workers failed to boot %d times in a row; giving up. The log lines above "
                    "say why (database unreachable? schema missing: run `outbox-farm migrate`?)",
                    self._boot_failures,
                    extra={"event": "halt"},
                )
                self._stop(graceful=False)
                return BOOT_ERROR
            self._murder_stale()
            self._manage()

    # -- children ------------------------------------------------------------------------

    def _active(self) -> list[Child]:
        return [c for c in self.children.values() if not c.retiring]

    def _spawn(self, slot: int) -> None:
        heartbeat = self.state_dir / f"heartbeat-{slot}-{time.monotonic_ns()}"
        spawned_at = time.time()
        heartbeat.touch()
        os.utime(heartbeat, (spawned_at - 1, spawned_at - 1))
        pid = os.fork()
        if pid == 0:
            if self._http is not None:
                self._http.close()
            os.close(self._pipe_r)
            os.close(self._pipe_w)
            run_child(self.farm, self.dsn, heartbeat, slot == 0, self.runtime_options)
        self.children[pid] = Child(pid, slot, spawned_at, heartbeat)
        self._processes.set(len(self.children))

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
            child = self.children.pop(pid, None)
            multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]
            self._processes.set(len(self.children))
            if child is None:
                continue
            child.heartbeat.unlink(missing_ok=True)
            code = os.waitstatus_to_exitcode(status)
            if child.retiring:
                continue
            booted = child.booted()
            self._restarts.inc()
            if booted and code != BOOT_ERROR:
                self._boot_failures = 0
                log.warning(
                    "worker %d (slot %d) died with status %s; replacing it",
                    pid,
                    child.slot,
                    code,
                    extra={"event": "worker_died"},
                )
                continue
            self._boot_failures += 1
            delay = min(0.5 * 2 ** (self._boot_failures - 1), 10.0)
            self._next_spawn_at = time.monotonic() + delay
            log.warning(
                "worker %d failed to boot (status %s); retrying in %.1fs",
                pid,
                code,
                delay,
                extra={"event": "boot_failed"},
            )

    def _murder_stale(self) -> None:
        now = time.time()
        for child in list(self.children.values()):
            limit = self.heartbeat_timeout if child.booted() else BOOT_TIMEOUT
            if child.silent_for(now) > limit:
                log.error(
                    "worker %d sent no heartbeat for %.0fs (event loop blocked?); killing it",
                    child.pid,
                    child.silent_for(now),
                    extra={"event": "worker_stuck"},
                )
                self._kill(child.pid, signal.SIGKILL)

    def _manage(self) -> None:
        active = self._active()
        if self._rolling:
            self._roll(active)
            return
        if len(active) > self.procs:
            for child in sorted(active, key=lambda c: c.slot)[self.procs :]:
                self._retire(child)
            return
        if len(active) < self.procs and time.monotonic() >= self._next_spawn_at:
            used = {c.slot for c in active}
            for slot in range(self.procs):
                if slot not in used:
                    self._spawn(slot)

    def _roll(self, active: list[Child]) -> None:
        """One step of a HUP: replace the next old child once its replacement has booted."""
        old_pid = self._rolling[0]
        old = self.children.get(old_pid)
        if old is None or old.retiring:
            self._rolling.pop(0)
            return
        fresh = [c for c in active if c.pid not in self._rolling and c.slot == old.slot]
        if not fresh:
            self._spawn(old.slot)
        elif fresh[0].booted():
            self._retire(old)
            self._rolling.pop(0)

    def _health(self) -> tuple[bool, dict[str, object]]:
        now = time.time()
        alive = sum(
            1 for c in self._active() if c.booted() and c.silent_for(now) <= self.heartbeat_timeout
        )
        return alive >= self.procs, {"procs": self.procs, "alive": alive, "pid": os.getpid()}

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
        # A worker's final flush may take up to 10 s past its graceful deadline; wait for it.
        deadline = time.monotonic() + (self.graceful_timeout + 15.0 if graceful else 5.0)
        while self.children and time.monotonic() < deadline:
            self._wait(0.1)
            stops = {signal.SIGQUIT, signal.SIGTERM, signal.SIGINT}
            if graceful and stops & set(self._signals):
                log.info(
                    "second stop signal: stopping at once", extra={"event": "arbiter_stopping"}
                )
                graceful = False
                deadline = min(deadline, time.monotonic() + 5.0)
                for child in self.children.values():
                    self._kill(child.pid, signal.SIGQUIT)
            self._signals.clear()
            self._reap()
        killed = list(self.children)
        for pid in killed:
            log.error(
                "worker %d did not stop in time; killing it", pid, extra={"event": "worker_killed"}
            )
            self._kill(pid, signal.SIGKILL)
        while self.children:
            try:
                pid, _ = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            self.children.pop(pid, None)
        self._processes.set(0)
        log.info("arbiter stopped", extra={"event": "arbiter_stopped"})
        return 1 if killed else 0
