"""What each signal sent to the arbiter asks of it, one `handle_<name>` method each.

TERM/INT graceful drain (children get TERM, then KILL at the deadline); QUIT immediate; HUP
rolling restart, one child at a time, each replacement booted before its predecessor is told
to drain; TTIN / TTOU one child more / less.

A fleet's HUP is first a request to read its set of databases again: every worker is sent
`RECHECK` and reads it at once, keeping the databases that stay where they are. Only when the
app's files changed since the workers were forked (or the last roll failed) does it roll the
workers out as well; with `--preload` it never does, as the workers could only be restarted on
the code they already run, moving every database for nothing.

Its own module because what a signal means is decided apart from how the arbiter's loop runs:
a handler only changes what the loop acts on in its next steps (the target count, the roll
under way, whether to stop), and never waits. The handlers run in the arbiter's main loop,
between two turns, never in the signal handler itself (`wakeup`).
"""

from __future__ import annotations

import logging
import signal
from typing import TYPE_CHECKING

from ..fleet.fleet import Fleet
from .rechecks import RECHECK

if TYPE_CHECKING:
    from ..settings import SupervisorSettings
    from .app import App
    from .beats import Child
    from .reloader import Rollout, SourceWatcher

log = logging.getLogger("outbox_farm.arbiter")


class SignalHandlers:
    """The arbiter's side that answers its signals; `Arbiter` holds the state they change."""

    if TYPE_CHECKING:  # the arbiter's, read and changed here
        farm: App
        settings: SupervisorSettings
        procs: int
        _stopping: bool | None
        _rollout: Rollout
        _watcher: SourceWatcher | None

        def _active(self) -> list[Child]: ...

        @staticmethod
        def _kill(pid: int, sig: int) -> None: ...

    def handle(self, signum: int) -> None:
        """Act on a queued signal through its `handle_<name>` method; one without is ignored."""
        name = signal.Signals(signum).name
        getattr(self, f"handle_{name[3:].lower()}", lambda: None)()

    def handle_term(self) -> None:
        self._stopping = True

    handle_int = handle_term

    def handle_quit(self) -> None:
        self._stopping = False

    def handle_hup(self) -> None:
        if isinstance(self.farm, Fleet):
            self._fleet_hup()
            return
        log.info(
            "HUP: rolling restart of %d children",
            len(self._active()),
            extra={"event": "rolling_restart"},
        )
        self._rollout.begin(c.pid for c in self._active())

    @property
    def _fleet_code_may_change(self) -> bool:
        """Whether a fleet's workers import its code afresh, so a HUP may bring them new code."""
        return isinstance(self.farm, Fleet) and not self.settings.preload

    def _fleet_hup(self) -> None:
        """Every worker reads the set now (one booting reads it once it serves, one forked
        later as it boots); and if the app's files changed since the workers were forked (or
        the last roll failed: the running code is not the code on disk), they are rolled out
        too. The one line logged says which."""
        children = self._active()
        for child in children:
            self._kill(child.pid, RECHECK)
        changed = None
        if self._fleet_code_may_change and self._watcher is not None:
            changed = self._watcher.changes()
            if self._rollout.failed is not None:
                changed = changed or "the last roll failed"
        if changed is None:
            if self.settings.preload:
                why = "--preload: the code is never imported again"
            else:
                why = "no code changed"
            rolling = " (the rolling restart under way goes on)" if self._rollout.pending else ""
            log.info(
                "HUP: every worker of the fleet reads its set of databases again; %s, no "
                "worker restarted%s",
                why,
                rolling,
                extra={"event": "fleet_reread", "procs": len(children)},
            )
            return
        log.info(
            "HUP: every worker of the fleet reads its set of databases again, and the code "
            "changed (%s): rolling restart of %d children",
            changed,
            len(children),
            extra={"event": "rolling_restart", "procs": len(children)},
        )
        self._rollout.begin(c.pid for c in children)

    def handle_ttin(self) -> None:
        self.procs += 1
        log.info("TTIN: %d processes", self.procs, extra={"event": "scaled", "procs": self.procs})

    def handle_ttou(self) -> None:
        if self.procs > 1:
            self.procs -= 1
            log.info(
                "TTOU: %d processes", self.procs, extra={"event": "scaled", "procs": self.procs}
            )
