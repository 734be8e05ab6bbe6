"""The files a worker and its arbiter share: both sides of them, so their meaning is written
down once. The worker's side is `Pulse`; the arbiter's record of the worker is `Child`.

The heartbeat file holds two CLOCK_MONOTONIC readings (system-wide on Linux, so comparable
across processes, and never stepped like the wall clock): when the runtime started (0 until it
has) and the latest beat. The worker replaces it every second from its event loop, from the
moment the loop runs, also while it waits for an unreachable database; an event loop blocked
past the arbiter's timeout stops replacing it, and the worker is replaced. The readings are the
file's content, not its timestamps: file times are wall-clock values to every other tool (and
tools that fake the clock for tests rewrite what stat returns).

Beside it, a second file holds why the worker is not serving: an unreachable database while it
waits to start, then the runtime's current permanent problem (a missing privilege or table);
empty while there is none. /healthz reports it as a problem (503). A worker that cannot boot
leaves its error's first line there as its last words, which the arbiter reads before it
removes the files: a failed reload is reported with it. A third file holds the runtime's
warnings, one a line (see `Runtime.warnings`): /healthz lists them as degraded (200).

One file is the arbiter's, for every worker: while the last reload failed, its error
(`reload_failure`), which the workers report with their code (see `chores.farm_code`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

log = logging.getLogger("outbox_farm.child")
HEARTBEAT_EVERY = 1.0
_BEAT = struct.Struct("<dd")  # booted at (0: not yet), last beat; monotonic seconds


def problem_path(heartbeat: Path) -> Path:
    return heartbeat.with_name(heartbeat.name + ".problem")


def warnings_path(heartbeat: Path) -> Path:
    return heartbeat.with_name(heartbeat.name + ".warnings")


def reload_failure_path(state_dir: Path) -> Path:
    return state_dir / "reload-failed"


def reload_failure(state_dir: Path) -> str | None:
    """Why the code on disk did not load at the last reload, while that is so."""
    try:
        return reload_failure_path(state_dir).read_text() or None
    except FileNotFoundError:
        return None


def _partial_path(heartbeat: Path) -> Path:
    return heartbeat.with_name(heartbeat.name + ".next")


@dataclass
class Child:
    """The arbiter's record of one worker it forked; written and read by the arbiter only.

    Whether the worker booted, and how long it has been silent, are read from its heartbeat
    file (see the module's docstring); times are `time.monotonic()` readings.
    """

    pid: int
    slot: int
    worker_id: int  # carried in every lease token the worker takes
    spawned_at: float
    heartbeat: Path
    retiring: bool = False  # told to drain (HUP, TTOU); not counted towards the target
    stale: bool = False  # its heartbeat went silent: asked for its stacks, then killed
    kill_at: float | None = None  # when a stale worker gets SIGKILL, once it had time to dump

    @staticmethod
    def new_heartbeat(state_dir: Path, slot: int) -> tuple[Path, float]:
        """A fresh, empty heartbeat file for a worker about to be forked, and its spawn time."""
        heartbeat = state_dir / f"heartbeat-{slot}-{time.monotonic_ns()}"
        heartbeat.touch()
        return heartbeat, time.monotonic()

    def _beat(self) -> tuple[float, float] | None:
        """(booted at, last beat) as the worker last wrote them; None before its first beat."""
        try:
            data = self.heartbeat.read_bytes()
        except FileNotFoundError:
            return None
        return _BEAT.unpack(data) if len(data) == _BEAT.size else None

    def booted(self) -> bool:
        """Whether the worker's runtime started (it may be waiting for its database)."""
        beat = self._beat()
        return beat is not None and beat[0] > 0

    def beating(self) -> bool:
        """Whether the worker's event loop runs: it beat at least once."""
        return self._beat() is not None

    def silent_for(self, now: float) -> float:
        """Seconds since the last beat (since the spawn, before the first) at monotonic `now`."""
        beat = self._beat()
        return now - (beat[1] if beat is not None else self.spawned_at)

    def problem(self) -> str | None:
        """Why the worker is not serving (database unreachable, a permanent error), if so."""
        try:
            return problem_path(self.heartbeat).read_text() or None
        except FileNotFoundError:
            return None

    def warnings(self) -> list[str]:
        """What degrades the worker without stopping it, one line each."""
        try:
            return warnings_path(self.heartbeat).read_text().splitlines()
        except FileNotFoundError:
            return []

    def forget(self) -> None:
        """Remove the worker's files once it is reaped."""
        for path in (
            self.heartbeat,
            _partial_path(self.heartbeat),
            problem_path(self.heartbeat),
            warnings_path(self.heartbeat),
        ):
            path.unlink(missing_ok=True)


class Serving(Protocol):
    """What a worker serves, as its files report it: a farm's runtime, or a fleet's process."""

    @property
    def problem(self) -> str | None: ...

    @property
    def warnings(self) -> list[str]: ...


class Pulse:
    """The worker's side of its heartbeat and problem files; owned by the worker's event loop.

    Until the runtime starts, `unready` says why it has not (the problem the arbiter shows);
    after `booted`, the runtime's own problem is shown instead.
    """

    def __init__(self, path: Path, arbiter: int, stop: asyncio.Event) -> None:
        self.path = path
        self.arbiter = arbiter
        self.stop = stop
        self.unready: str | None = None
        self._runtime: Serving | None = None
        self._booted_at = 0.0
        self._reported: str | None = None
        self._warned: list[str] = []

    def booted(self, runtime: Serving) -> None:
        """The runtime started: say so at once (a rolling restart waits for it)."""
        self._runtime = runtime
        self.unready = None
        self._booted_at = time.monotonic()
        self.beat()

    def beat(self) -> None:
        problem = self._runtime.problem if self._runtime is not None else self.unready
        if problem != self._reported:
            problem_path(self.path).write_text(problem or "")
            self._reported = problem
        warnings = list(self._runtime.warnings) if self._runtime is not None else []
        if warnings != self._warned:
            warnings_path(self.path).write_text("\n".join(warnings))
            self._warned = warnings
        # Replaced, not rewritten: the arbiter never reads half a beat.
        partial = _partial_path(self.path)
        partial.write_bytes(_BEAT.pack(self._booted_at, time.monotonic()))
        os.replace(partial, self.path)

    async def run(self) -> None:
        while True:
            if os.getppid() != self.arbiter:  # the arbiter died (OOM killer, SIGKILL)
                log.error("arbiter %d is gone; draining", self.arbiter, extra={"event": "orphaned"})
                self.stop.set()
                return
            self.beat()
            await asyncio.sleep(HEARTBEAT_EVERY)
