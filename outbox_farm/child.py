"""What a forked worker process runs: the runtime on its own uvloop, plus a heartbeat; and the
arbiter's side of that heartbeat, the `Child` record.

The heartbeat is a file whose mtime the child refreshes every second from its event loop; an
event loop blocked past the arbiter's timeout stops refreshing it and the child is replaced.
The first refresh happens only after the runtime started, so it also marks "booted". Beside it,
a second file holds the runtime's current permanent problem (a missing privilege or table),
empty while there is none: the arbiter's /healthz reports it. Both sides of these files live
here, so their meaning is written down once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from .errors import OutboxFarmError
from .farm import Farm
from .runtime import Runtime
from .settings import RuntimeSettings

if TYPE_CHECKING:
    from .app import AppLoader

log = logging.getLogger("outbox_farm.child")
BOOT_ERROR = 3  # exit status of a child that could not start its runtime
# What the arbiter handles itself; a fresh child puts them back to their defaults.
ARBITER_SIGNALS = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGHUP,
    signal.SIGTTIN,
    signal.SIGTTOU,
    signal.SIGCHLD,
)
HEARTBEAT_EVERY = 1.0


class BootError(Exception):
    """The runtime could not start."""


def problem_path(heartbeat: Path) -> Path:
    return heartbeat.with_name(heartbeat.name + ".problem")


def describe_exit(code: int) -> str:
    """`status 1` or `signal SIGKILL`, from `os.waitstatus_to_exitcode`."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


@dataclass
class Child:
    """The arbiter's record of one worker it forked; written and read by the arbiter only.

    Whether the worker booted, and how long it has been silent, are read from its heartbeat
    file: `new_heartbeat` dates it before the fork, so only the worker's first beat marks it booted.
    """

    pid: int
    slot: int
    worker_id: int  # carried in every lease token the worker takes
    spawned_at: float
    heartbeat: Path
    retiring: bool = False  # told to drain (HUP, TTOU); not counted towards the target
    stale: bool = False  # killed by the arbiter for a silent heartbeat

    @staticmethod
    def new_heartbeat(state_dir: Path, slot: int) -> tuple[Path, float]:
        """A fresh heartbeat file for a worker about to be forked, and its spawn time."""
        heartbeat = state_dir / f"heartbeat-{slot}-{time.monotonic_ns()}"
        spawned_at = time.time()
        heartbeat.touch()
        os.utime(heartbeat, (spawned_at - 1, spawned_at - 1))
        return heartbeat, spawned_at

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
        """The permanent error the worker reports, if any."""
        try:
            return problem_path(self.heartbeat).read_text() or None
        except FileNotFoundError:
            return None

    def forget(self) -> None:
        """Remove the worker's files once it is reaped."""
        self.heartbeat.unlink(missing_ok=True)
        problem_path(self.heartbeat).unlink(missing_ok=True)


def run_child(
    farm: Farm,
    loader: AppLoader | None,
    dsn: str,
    heartbeat: Path,
    settings: RuntimeSettings,
) -> NoReturn:
    """Entry point right after fork; never returns (os._exit skips the parent's atexit).

    With a `loader`, the app is imported again here, from the files on disk, so a HUP rolls out
    new code. `settings` are this worker's own (see `RuntimeSettings.for_worker`).
    """
    for sig in ARBITER_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    # The arbiter forks with these blocked: one sent to this process before the line above
    # would have run the arbiter's handler, in this copy of the arbiter, and been lost.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, ARBITER_SIGNALS)
    code = 0
    arbiter = os.getppid()
    try:
        import uvloop

        if loader is not None:
            try:
                farm = loader.reload()
            except OutboxFarmError as exc:
                raise BootError(str(exc)) from exc
        uvloop.run(_main(farm, dsn, heartbeat, settings, arbiter))
    except BootError as exc:
        log.error("worker could not start: %s", exc, extra={"event": "boot_failed"})
        code = BOOT_ERROR
    except BaseException:
        log.exception("worker crashed", extra={"event": "worker_crashed"})
        code = 1
    finally:
        logging.shutdown()
    os._exit(code)


async def _heartbeat(path: Path, runtime: Runtime, arbiter: int, stop: asyncio.Event) -> None:
    reported: str | None = None
    while True:
        if os.getppid() != arbiter:  # the arbiter died (OOM killer, SIGKILL): nobody supervises
            log.error("arbiter %d is gone; draining", arbiter, extra={"event": "orphaned"})
            stop.set()
            return
        problem = runtime.problem
        if problem != reported:
            problem_path(path).write_text(problem or "")
            reported = problem
        now = time.time()
        os.utime(path, (now, now))
        await asyncio.sleep(HEARTBEAT_EVERY)


async def _main(
    farm: Farm,
    dsn: str,
    heartbeat: Path,
    settings: RuntimeSettings,
    arbiter: int,
) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    # Immediate stop: no drain; claimed rows come back when their leases expire.
    loop.add_signal_handler(signal.SIGQUIT, os._exit, 0)
    runtime = Runtime(list(farm.handlers.values()), farm.queries, dsn, settings, farm.observers)
    try:
        await runtime.start()
    except OutboxFarmError as exc:
        await runtime.stop(0)
        raise BootError(str(exc)) from exc
    beat = asyncio.create_task(_heartbeat(heartbeat, runtime, arbiter, stop))
    try:
        await stop.wait()
        log.info("draining", extra={"event": "draining"})
        await runtime.stop()
    finally:
        beat.cancel()
