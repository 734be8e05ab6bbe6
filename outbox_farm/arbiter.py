"""The arbiter: forks N worker processes and keeps them alive (prefork, like gunicorn's).

Signal handlers only queue the signal and poke a self-pipe; one main loop wakes at least once a
second and, in order: answers /metrics and /healthz, handles queued signals (each through its
`handle_<name>` method), reaps dead children, kills children whose heartbeat went stale, and
spawns or retires children until the target count runs. The arbiter holds no event loop,
thread or database connection when it forks.

A worker that booted and later died is a crash: it is replaced at once (its slot backs off only
when it crashes faster than about once a second) and the rows it held are handed back at once.
Only workers that never finished booting count toward the halt: five in a row mean the farm
cannot start (bad DSN, missing schema, an app that no longer imports) and it exits with
status 3 instead of fork-looping.

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
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from . import exposition, leases
from .app import AppLoader
from .child import ARBITER_SIGNALS, BOOT_ERROR, problem_path, run_child
from .dsn import redact
from .farm import Farm
from .settings import RuntimeSettings

log = logging.getLogger("outbox_farm.arbiter")
MAX_BOOT_FAILURES = 5
BOOT_TIMEOUT = 60.0
QUICK_CRASH = 1.0  # a slot whose worker dies sooner than this after the last crash backs off
GAUGES_INTERVAL = 5.0  # seconds between the housekeeper's refreshes of the database gauges
RELEASE_TIMEOUT = 5.0  # seconds the arbiter spends handing back a dead worker's rows


@dataclass
class Child:
    pid: int
    slot: int
    worker_id: int  # carried in every lease token the worker takes
    spawned_at: float
    heartbeat: Path
    retiring: bool = False  # told to drain (HUP, TTOU); not counted towards the target
    stale: bool = False  # killed by the arbiter for a silent heartbeat

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

    def problem(self) -> str | None:
        """The permanent error the worker reports (see `child`), if any."""
        try:
            return problem_path(self.heartbeat).read_text() or None
        except FileNotFoundError:
            return None


def describe_exit(code: int) -> str:
    """`status 1` or `signal SIGKILL`, from `os.waitstatus_to_exitcode`."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


@dataclass
class Arbiter:
    """Supervises `procs` children running `farm` against `dsn`.

    With a `loader` and no `preload`, each child imports the app afresh after the fork;
    with `reload`, a change to a `.py` file of the app replaces every child (development).
    Everything here is owned by the one arbiter thread; signal handlers only append to
    `_signals`.
    """

    farm: Farm
    dsn: str
    procs: int
    state_dir: Path
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)
    graceful_timeout: float = 30.0
    heartbeat_timeout: float = 30.0
    metrics_bind: str | None = "127.0.0.1:9464"
    loader: AppLoader | None = None
    preload: bool = False
    reload: bool = False
    children: dict[int, Child] = field(default_factory=dict)
    _signals: list[int] = field(default_factory=list)
    _boot_failures: int = 0  # children in a row that died before booting
    _next_spawn_at: float = 0.0  # boot-failure backoff, for every slot (monotonic)
    _slot_crashes: dict[int, tuple[int, float]] = field(default_factory=dict)  # n, last (mono)
    _slot_wait: dict[int, float] = field(default_factory=dict)  # crash backoff (monotonic)
    _rolling: list[int] = field(default_factory=list)  # pids awaiting a HUP replacement
    _sources: dict[Path, float] = field(default_factory=dict)  # --reload: watched files
    _stopping: bool | None = None  # set by a stop signal: True graceful, False immediate
    _http: socket.socket | None = None
    _pipe_r: int = -1
    _pipe_w: int = -1
    _processes: Any = None
    _restarts: Any = None

    def run(self) -> int:
        """Supervise until told to stop; the process exit status."""
        from prometheus_client import Counter, Gauge

        self._processes = Gauge(
            "outbox_farm_processes", "Worker processes running.", multiprocess_mode="max"
        )
        self._restarts = Counter(
            "outbox_farm_worker_restarts",
            "Worker processes replaced, by why the old one ended: crash (died after booting), "
            "heartbeat (killed for a blocked event loop), boot (died before booting).",
            ["reason"],
        )
        self._http = exposition.listen(self.metrics_bind) if self.metrics_bind else None
        self._pipe_r, self._pipe_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        for sig in ARBITER_SIGNALS:
            signal.signal(sig, self._on_signal)
        signal.set_wakeup_fd(self._pipe_w)
        if self.reload and self.loader is not None:
            self._sources = self.loader.sources()
        bound = "(off)"
        if self._http is not None:
            host, port = self._http.getsockname()[:2]
            bound = f"{host}:{port}"
        log.info(
            "arbiter started: %d processes, metrics on %s%s",
            self.procs,
            bound,
            ", reloading on code changes" if self.reload else "",
            extra={"event": "arbiter_started", "metrics_bind": bound},
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
            while self._signals and self._stopping is None:
                name = signal.Signals(self._signals.pop(0)).name
                getattr(self, f"handle_{name[3:].lower()}", lambda: None)()
            if self._stopping is not None:
                return self._stop(graceful=self._stopping)
            self._reap()
            if self._boot_failures >= MAX_BOOT_FAILURES:
                log.error(
                    "workers failed to boot %d times in a row; giving up. The log lines above "
                    "say why (database unreachable? schema missing: run `outbox-farm migrate`? "
                    "the app no longer imports?)",
                    self._boot_failures,
                    extra={"event": "halt"},
                )
                self._stop(graceful=False)
                return BOOT_ERROR
            self._murder_stale()
            self._watch_sources()
            self._manage()

    # -- signals -------------------------------------------------------------------------

    def handle_term(self) -> None:
        self._stopping = True

    handle_int = handle_term

    def handle_quit(self) -> None:
        self._stopping = False

    def handle_hup(self) -> None:
        log.info(
            "HUP: rolling restart of %d children",
            len(self._active()),
            extra={"event": "rolling_restart"},
        )
        self._rolling = [c.pid for c in self._active()]

    def handle_ttin(self) -> None:
        self.procs += 1
        log.info("TTIN: %d processes", self.procs, extra={"event": "scaled", "procs": self.procs})

    def handle_ttou(self) -> None:
        if self.procs > 1:
            self.procs -= 1
            log.info(
                "TTOU: %d processes", self.procs, extra={"event": "scaled", "procs": self.procs}
            )

    # -- children ------------------------------------------------------------------------

    def _active(self) -> list[Child]:
        return [c for c in self.children.values() if not c.retiring]

    def _spawn(self, slot: int) -> None:
        heartbeat = self.state_dir / f"heartbeat-{slot}-{time.monotonic_ns()}"
        spawned_at = time.time()
        heartbeat.touch()
        os.utime(heartbeat, (spawned_at - 1, spawned_at - 1))
        worker_id = int.from_bytes(os.urandom(4), "big") & 0x7FFFFFFF
        # One process of the farm is the housekeeper: it alone refreshes the database-derived
        # gauges, vacuums the table and prunes the DLQ.
        settings = self.runtime.for_worker(
            worker_id, housekeeper=slot == 0, gauges_interval=GAUGES_INTERVAL
        )
        loader = None if self.preload else self.loader
        pid = os.fork()
        if pid == 0:
            if self._http is not None:
                self._http.close()
            os.close(self._pipe_r)
            os.close(self._pipe_w)
            run_child(self.farm, loader, self.dsn, heartbeat, settings)
        self.children[pid] = Child(pid, slot, worker_id, spawned_at, heartbeat)
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
            booted = child.booted()  # before the heartbeat file goes: it is the evidence
            child.heartbeat.unlink(missing_ok=True)
            problem_path(child.heartbeat).unlink(missing_ok=True)
            code = os.waitstatus_to_exitcode(status)
            if code != 0:
                self._release(child)
            if not child.retiring:
                self._died(child, booted and code != BOOT_ERROR, code)

    def _died(self, child: Child, booted: bool, code: int) -> None:
        """Account for a child that died without being told to, and schedule its successor."""
        how = describe_exit(code)
        replacing = any(
            old is not None and old.slot == child.slot
            for old in (self.children.get(pid) for pid in self._rolling)
        )
        if booted:
            reason = "heartbeat" if child.stale else "crash"
            self._boot_failures = 0
            now = time.monotonic()
            crashes, last = self._slot_crashes.get(child.slot, (0, -QUICK_CRASH))
            crashes = crashes + 1 if now - last < QUICK_CRASH else 0
            self._slot_crashes[child.slot] = (crashes, now)
            delay = min(0.25 * 2**crashes, 10.0) if crashes else 0.0
            self._slot_wait[child.slot] = now + delay
            log.warning(
                "worker %d (slot %d) died (%s); %s",
                child.pid,
                child.slot,
                how,
                f"replacing it in {delay:.1f}s" if delay else "replacing it",
                extra={"event": "worker_died", "reason": reason, "exit": how, "slot": child.slot},
            )
        else:
            reason = "boot"
            if replacing:
                # A HUP's replacement that cannot boot (a broken deploy): keep the running
                # workers on the old code rather than trading them for ones that cannot start.
                self._rolling.clear()
                log.error(
                    "new worker %d failed to boot (%s); rolling restart abandoned, the running "
                    "workers keep the code they have",
                    child.pid,
                    how,
                    extra={"event": "rolling_restart_failed", "exit": how},
                )
            else:
                self._boot_failures += 1
                delay = min(0.5 * 2 ** (self._boot_failures - 1), 10.0)
                self._next_spawn_at = time.monotonic() + delay
                log.warning(
                    "worker %d failed to boot (%s); retrying in %.1fs",
                    child.pid,
                    how,
                    delay,
                    extra={"event": "boot_failed", "exit": how},
                )
        self._restarts.labels(reason).inc()

    def _release(self, child: Child) -> None:
        """Hand back the rows a dead worker held, so they run again now, not when their leases
        expire. Best effort: if the database cannot be reached, the leases still expire."""
        try:
            with psycopg.connect(
                self.dsn,
                autocommit=True,
                connect_timeout=int(RELEASE_TIMEOUT),
                options=f"-c statement_timeout={int(RELEASE_TIMEOUT * 1000)}",
            ) as conn:
                released = leases.release_worker(conn, self.farm.queries, child.worker_id)
        except psycopg.Error as exc:
            log.warning(
                "could not hand back the rows of dead worker %d on %s (%s); they are delivered "
                "again when their leases expire",
                child.pid,
                redact(self.dsn),
                str(exc).strip(),
                extra={"event": "release_failed"},
            )
            return
        if released:
            log.info(
                "handed back %d rows held by dead worker %d",
                released,
                child.pid,
                extra={"event": "leases_released", "rows": released},
            )

    def _murder_stale(self) -> None:
        now = time.time()
        for child in list(self.children.values()):
            limit = self.heartbeat_timeout if child.booted() else BOOT_TIMEOUT
            if child.silent_for(now) > limit and not child.stale:
                log.error(
                    "worker %d sent no heartbeat for %.0fs (event loop blocked?); killing it",
                    child.pid,
                    child.silent_for(now),
                    extra={"event": "worker_stuck"},
                )
                child.stale = True
                self._kill(child.pid, signal.SIGKILL)

    def _watch_sources(self) -> None:
        if not (self.reload and self.loader is not None) or self._rolling:
            return
        now = self.loader.sources()
        if now != self._sources:
            changed = sorted(str(p) for p in set(now) ^ set(self._sources)) or sorted(
                str(p) for p in now if now[p] != self._sources.get(p)
            )
            self._sources = now
            log.info(
                "code changed (%s); replacing every worker",
                ", ".join(changed[:3]) + (" ..." if len(changed) > 3 else ""),
                extra={"event": "reload"},
            )
            self._rolling = [c.pid for c in self._active()]

    def _manage(self) -> None:
        active = self._active()
        if self._rolling:
            self._roll(active)
            return
        if len(active) > self.procs:
            for child in sorted(active, key=lambda c: c.slot)[self.procs :]:
                self._retire(child)
            return
        now = time.monotonic()
        if len(active) < self.procs and now >= self._next_spawn_at:
            used = {c.slot for c in active}
            for slot in range(self.procs):
                if slot not in used and now >= self._slot_wait.get(slot, 0.0):
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
        live = [
            c for c in self._active() if c.booted() and c.silent_for(now) <= self.heartbeat_timeout
        ]
        problems = sorted({p for p in (c.problem() for c in live) if p})
        detail: dict[str, object] = {"procs": self.procs, "alive": len(live), "pid": os.getpid()}
        if problems:
            detail["problems"] = problems
        return len(live) >= self.procs and not problems, detail

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
            gone = self.children.pop(pid, None)
            if gone is not None:
                self._release(gone)
        self._processes.set(0)
        log.info("arbiter stopped", extra={"event": "arbiter_stopped"})
        return 1 if killed else 0
