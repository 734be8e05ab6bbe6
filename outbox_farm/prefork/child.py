"""What a forked worker process runs: the runtime on its own uvloop, plus a heartbeat (its
files, and the arbiter's `Child` record of the worker, are in `beats`).

A worker whose database cannot be reached at boot (refused, timed out, starting up or shutting
down) waits it out with jittered backoff; only failures that retrying cannot fix (the app does
not import, bad settings, a missing table or privilege) end it with `BOOT_ERROR`, which the
arbiter counts toward giving up.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import signal
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, Protocol

from ..backoff import Backoff
from ..db.boundary import translate
from ..dsn import scrub
from ..errors import ConnectionLost, OutboxFarmError
from ..farm import Farm
from ..fleet.fleet import Fleet
from ..fleet.member import FleetMember
from ..problems import one_line
from ..settings import RuntimeSettings
from ..worker.runtime import Runtime
from ..worker.supervised import started_unless_stopped
from .beats import Pulse, Serving, problem_path, reload_failure
from .heap import freeze_boot_heap
from .rechecks import RECHECK, Rechecks

if TYPE_CHECKING:
    from .app import AppLoader

log = logging.getLogger("outbox_farm.child")
BOOT_ERROR = 3  # exit status of a child whose runtime cannot start, however often it tries
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
# Sent by the arbiter to a worker whose heartbeat went silent, shortly before SIGKILL: the
# worker's Python stacks go to stderr, so the log shows where its event loop was stuck.
# (faulthandler may not take SIGABRT, which gunicorn uses: that one is faulthandler's own.)
STACK_DUMP = signal.SIGUSR2
# Blocked across the arbiter's fork: its own signals, and what it sends its workers (until a
# fresh process has its own handling of them, see `forked`).
FORK_BLOCKED = (*ARBITER_SIGNALS, RECHECK)
WORKER_NAME = "outbox-worker"  # what ps and top show for a worker (the arbiter keeps its own)
RETRY_FIRST = 0.5  # seconds before the second attempt to reach the database at boot
RETRY_CAP = 5.0  # the longest wait between two attempts
RETRY_LOG_EVERY = 30.0  # seconds between two log lines saying the database is still unreachable


class BootError(Exception):
    """The runtime could not start, and retrying will not change that."""


class Served(Serving, Protocol):
    """What a worker runs: a farm's `Runtime`, or a fleet's `FleetMember`."""

    fatal: asyncio.Event
    fatal_reason: str | None

    async def start(self) -> None: ...

    async def stop(self, graceful_timeout: float | None = None) -> None: ...


def describe_exit(code: int) -> str:
    """`status 1` or `signal SIGKILL`, from `os.waitstatus_to_exitcode`."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


def unreachable(exc: Exception, dsn: str) -> str | None:
    """Why the database could not be reached, when that is all `exc` (raised while starting the
    runtime) says; None for an error that retrying does not fix.

    Unreachable is what the storage layer's one translation calls a lost connection: no
    connection could be had or it broke (no SQLSTATE from a connection attempt, class 08, the
    server starting up, shutting down or full). The connection probe raises a
    ConfigurationError whose context is the driver's error, so that context is translated too.
    The reason is the error's first line, with anything of the DSN's secret masked: it goes to
    /healthz.
    """
    driver = exc.__cause__ or exc.__context__
    if isinstance(translate(exc), ConnectionLost) or (
        driver is not None and isinstance(translate(driver), ConnectionLost)
    ):
        return scrub(one_line(exc), dsn)
    return None


def forked(name: str) -> None:
    """In a process the arbiter just forked: named `name` for ps and top, the arbiter's signals
    back to their default handling, then unblocked. The arbiter forks with them blocked: one
    delivered before the reset would run the arbiter's handler, in this copy of the arbiter,
    and be lost. `RECHECK` (a fleet's HUP, sent to the workers) is ignored until the worker's
    event loop handles it."""
    # Linux keeps 15 bytes of it; elsewhere there is no such file, and the name stays.
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(name[:15])
    for sig in ARBITER_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    # Until a worker's event loop handles it (`rechecks`): a fleet's HUP must not end a worker
    # that is still importing its app, and the worker reads the set when it boots anyway.
    signal.signal(RECHECK, signal.SIG_IGN)
    signal.set_wakeup_fd(-1)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORK_BLOCKED)


def run_child(
    farm: Farm | Fleet,
    loader: AppLoader | None,
    dsn: str,
    heartbeat: Path,
    settings: RuntimeSettings,
) -> NoReturn:
    """Entry point right after fork; never returns (os._exit skips the parent's atexit).

    With a `loader`, the app is imported again here, from the files on disk, so a HUP rolls out
    new code. `settings` are this worker's own (see `RuntimeSettings.for_worker`).
    """
    faulthandler.register(STACK_DUMP, all_threads=True, chain=False)
    forked(WORKER_NAME)
    code = 0
    arbiter = os.getppid()
    try:
        import uvloop

        if loader is not None:
            try:
                farm = loader.reload()
            except OutboxFarmError as exc:
                raise BootError(str(exc)) from exc
        code = uvloop.run(_main(farm, dsn, heartbeat, settings, arbiter))
    except BootError as exc:
        # Our own errors say what to fix; anything else is a bug, whose traceback says where.
        cause = exc.__cause__
        trace = None if isinstance(cause, OutboxFarmError) else cause
        log.error("worker could not start: %s", exc, exc_info=trace, extra={"event": "boot_failed"})
        problem_path(heartbeat).write_text(scrub(one_line(exc), dsn))
        code = BOOT_ERROR
    except BaseException:
        log.exception("worker crashed", extra={"event": "worker_crashed"})
        code = 1
    finally:
        logging.shutdown()
    os._exit(code)


async def _main(
    farm: Farm | Fleet,
    dsn: str,
    heartbeat: Path,
    settings: RuntimeSettings,
    arbiter: int,
) -> int:
    """The worker's life on its event loop; its exit status."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    # Immediate stop: no drain; claimed rows come back when their leases expire.
    loop.add_signal_handler(signal.SIGQUIT, os._exit, 0)
    rechecks = Rechecks()
    loop.add_signal_handler(RECHECK, rechecks.ask)  # a fleet's HUP; kept until booted
    pulse = Pulse(heartbeat, arbiter, stop)
    beat = asyncio.create_task(pulse.run())
    try:
        runtime = await _boot(partial(_served, farm, dsn, heartbeat, settings), dsn, pulse, stop)
        if runtime is None:
            return 0
        pulse.booted(runtime)
        if isinstance(runtime, FleetMember):
            rechecks.attach(runtime.recheck)
        frozen = freeze_boot_heap()  # see `heap`: no full collection walks the boot's objects
        log.debug("froze %d objects of the boot", frozen, extra={"event": "heap_frozen"})
        return await _serve(runtime, stop)
    finally:
        beat.cancel()


def _served(farm: Farm | Fleet, dsn: str, heartbeat: Path, settings: RuntimeSettings) -> Served:
    """What this worker serves: the farm's runtime, or its share of a fleet's databases."""
    if isinstance(farm, Fleet):
        return FleetMember(farm, dsn, settings)
    return Runtime(
        list(farm.handlers.values()),
        farm.queries,
        dsn,
        settings,
        farm.observers,
        code_note=partial(reload_failure, heartbeat.parent),
    )


async def _boot(
    make: Callable[[], Served], dsn: str, pulse: Pulse, stop: asyncio.Event
) -> Served | None:
    """A started runtime, once the database can be reached; None if told to stop first.

    Each attempt gets a fresh runtime: a failed start closes what it opened and cannot run
    again. BootError for any other failure: retrying would only fail the same way (the farm
    gives up after a few, rather than fork-looping).
    """
    backoff = Backoff(RETRY_FIRST, RETRY_CAP)
    logged_at = -RETRY_LOG_EVERY
    while True:
        try:
            runtime = make()
            if not await _start(runtime, stop):
                return None
        except Exception as exc:
            reason = unreachable(exc, dsn)
            if reason is None:
                raise BootError(str(exc)) from exc
            pulse.unready = f"database unreachable: {reason}"
            delay = backoff.next()
            if time.monotonic() - logged_at >= RETRY_LOG_EVERY:
                logged_at = time.monotonic()
                log.warning(
                    "%s; waiting for it (retrying with backoff, at most every %.0fs; this "
                    "line repeats every %.0fs while it lasts). Check that the server runs and "
                    "that this host reaches it",
                    pulse.unready,
                    RETRY_CAP,
                    RETRY_LOG_EVERY,
                    extra={"event": "database_unreachable"},
                )
            try:
                await asyncio.wait_for(stop.wait(), delay)
                return None
            except TimeoutError:
                continue
        if backoff.failures:
            log.info("database reachable again", extra={"event": "database_reachable"})
        return runtime


async def _start(runtime: Served, stop: asyncio.Event) -> bool:
    """Start `runtime` unless `stop` is set first; a start stopped or failed closes what it
    opened (False when stopped)."""
    try:
        started = await started_unless_stopped(runtime.start(), stop)
    except Exception:
        await runtime.stop(0)
        raise
    if not started:
        await runtime.stop(0)
    return started


async def _serve(runtime: Served, stop: asyncio.Event) -> int:
    """Run until told to stop (drain, 0) or until a part of the runtime failed for good (drain
    what can be, then 1: the arbiter replaces this worker as it would after a crash)."""
    stopped = asyncio.create_task(stop.wait())
    failed = asyncio.create_task(runtime.fatal.wait())
    try:
        await asyncio.wait({stopped, failed}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        failed.cancel()
    if runtime.fatal.is_set():
        log.error(
            "worker failed: %s; draining, then exiting so that the arbiter replaces it",
            runtime.fatal_reason,
            extra={"event": "worker_failed"},
        )
        await runtime.stop()
        return 1
    log.info("draining", extra={"event": "draining"})
    await runtime.stop()
    return 0
