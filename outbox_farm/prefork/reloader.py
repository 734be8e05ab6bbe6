"""Rolling restarts (HUP, and `start --reload` when the app's source files change), and what
the farm says when one fails.

The source files are polled from the arbiter's main loop, about once a second: no thread, no
inotify, nothing the arbiter would hold across a fork. A roll replaces one worker at a time,
each replacement booted before its predecessor is told to drain. A replacement that cannot
boot (a broken deploy) abandons the roll: the running workers keep the code they have, which
is then no longer the code on disk. That is not an outage, so /healthz stays 200, but it must
not be silent either: until a later roll completes, the health detail's `degraded` list says so
with the new code's error, `outbox_farm_reload_failed` reads 1, and the error is in a file of
the state directory (`beats.reload_failure`) that the workers pass on with their code's report
to the database, where `doctor` finds it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..metrics import supervisor_metrics
from .app import AppLoader
from .beats import Child, reload_failure_path

log = logging.getLogger("outbox_farm.arbiter")

SHOWN = 3  # changed files named in the log line


class SourceWatcher:
    """The mtimes of the app's `.py` files at the last look; owned by the arbiter thread."""

    def __init__(self, loader: AppLoader) -> None:
        self.loader = loader
        self.seen: dict[Path, float] = loader.sources()

    def changes(self) -> str | None:
        """The files added, removed or modified since the last call, for a log line; None when
        nothing changed."""
        now = self.loader.sources()
        if now == self.seen:
            return None
        changed = sorted(str(p) for p in set(now) ^ set(self.seen)) or sorted(
            str(p) for p in now if now[p] != self.seen.get(p)
        )
        self.seen = now
        return ", ".join(changed[:SHOWN]) + (" ..." if len(changed) > SHOWN else "")


@dataclass
class Rollout:
    """The rolling restart under way, if any, and how the last one ended; written and read by
    the arbiter thread only (the workers read the file of `state_dir` it keeps)."""

    state_dir: Path
    pending: list[int] = field(default_factory=list)  # old workers' pids awaiting a successor
    failed: str | None = None  # the boot error that abandoned the last roll, until one completes
    _booted_one: bool = False  # a replacement of this roll booted: the code on disk runs

    def begin(self, pids: Iterable[int]) -> None:
        self.pending = list(pids)
        self._booted_one = False

    def replacing(self, slot: int, children: dict[int, Child]) -> bool:
        """Whether `slot` has an old worker waiting for its replacement."""
        return any(
            old is not None and old.slot == slot
            for old in (children.get(pid) for pid in self.pending)
        )

    def abandon(self, error: str) -> None:
        """A replacement could not boot with `error` (its first line): the roll stops here."""
        self.pending.clear()
        self.failed = error
        supervisor_metrics().reload_failed.set(1)
        self._record(error)

    def step(
        self,
        children: dict[int, Child],
        active: list[Child],
        spawn: Callable[[int], None],
        retire: Callable[[Child], None],
    ) -> None:
        """Replace the next old worker once its replacement has booted (spawning that first)."""
        old = children.get(self.pending[0])
        if old is None or old.retiring:
            self._next()
            return
        fresh = [c for c in active if c.pid not in self.pending and c.slot == old.slot]
        if not fresh:
            spawn(old.slot)
        elif fresh[0].booted():
            self._booted_one = True
            retire(old)
            self._next()

    def _next(self) -> None:
        self.pending.pop(0)
        if not self.pending and self._booted_one and self.failed is not None:
            self.failed = None
            supervisor_metrics().reload_failed.set(0)
            self._record(None)

    def _record(self, error: str | None) -> None:
        """Write (or, for None, remove) the file the workers pass on to `doctor`. A full disk
        or a removed state directory costs `doctor` that line, never the arbiter's loop: the
        gauge and /healthz carry the state from memory."""
        path = reload_failure_path(self.state_dir)
        try:
            if error is None:
                path.unlink(missing_ok=True)
            else:
                path.write_text(error)
        except OSError as exc:
            log.warning(
                "could not record the reload's state in %s (%s); doctor will not show it",
                path,
                exc,
                extra={"event": "reload_state_unwritten"},
            )

    def degraded(self) -> list[str]:
        """What /healthz lists as degraded on the roll's account."""
        if self.failed is None:
            return []
        return [
            "the running code is not the code on disk: the last reload failed and the workers "
            f"kept their code ({self.failed}); fix the code, then reload again (HUP)"
        ]
