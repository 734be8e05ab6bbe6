"""A fleet's HUP, in its workers: the arbiter sends each worker `RECHECK`, and the worker has
its fleet member read the set of databases at once (`FleetMember.recheck`).

A request must never cost a worker its life, nor be lost. From the fork until the worker's
event loop handles the signal, it is ignored (its default action would end the process): the
worker reads the set when it boots, after that. Once the loop handles it, a request that
arrives while the worker is still booting (waiting for its database, or taking its first
share) is kept and passed on as soon as the member serves, so a boot that read the set just
before the file changed reads it again.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

# SIGUSR2 is the stack dump of a stuck worker (`child.STACK_DUMP`); TERM, INT, QUIT stop it.
RECHECK = signal.SIGUSR1


class Rechecks:
    """The worker's requests to read the set again, owned by its event loop's thread."""

    def __init__(self) -> None:
        self.asked = False  # a request arrived before anything could take it
        self._target: Callable[[], None] | None = None

    def ask(self) -> None:
        """The loop's handler of `RECHECK`."""
        if self._target is None:
            self.asked = True
        else:
            self._target()

    def attach(self, target: Callable[[], None]) -> None:
        """From now on, requests go to `target`, starting with one that arrived before."""
        self._target = target
        if self.asked:
            self.asked = False
            target()
