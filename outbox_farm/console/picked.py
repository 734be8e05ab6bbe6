"""The database a request works on: the console's one database, or the one of a fleet's set
its URL names (`/db/NAME/...`, checked by `sets.PickedDatabase` before any page runs).

Every page and action reaches its database through `picked(request)` only, so none can read
one database and act on another: its links start with `root` (the database's prefix), and a
plan of a replay, purge or queue change is signed for the session *and* the database
(`plan_key`): a confirmation made on database A, posted to database B, is refused.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from starlette.requests import Request

from .database import Database

SEEN_FOR = 15 * 60.0  # seconds a queue that drained stays on the overview
SEEN_MAX = 1000  # queues remembered as having had rows


class Recent:
    """The queues that had rows lately, and when: a queue that drains stays on the overview
    for `SEEN_FOR` seconds, then is forgotten; at most `SEEN_MAX` are kept. Shared by the
    overview's requests, which run in the thread pool: hence the lock."""

    def __init__(self) -> None:
        self._at: dict[str, float] = {}  # oldest first
        self._lock = threading.Lock()

    def note(self, queues: set[str], now: float) -> set[str]:
        """Note `queues` as having rows at `now`; the queues remembered."""
        with self._lock:
            for queue in queues:
                self._at.pop(queue, None)
                self._at[queue] = now
            for queue in [q for q, at in self._at.items() if now - at > SEEN_FOR]:
                del self._at[queue]
            while len(self._at) > SEEN_MAX:
                del self._at[next(iter(self._at))]
            return set(self._at)


@dataclass
class Picked:
    """One database as the console serves it: `name` (None: the console's only database),
    its connections, the queues its overview saw lately, and the prefix of its pages' paths."""

    database: Database
    name: str | None = None
    recent: Recent = field(default_factory=Recent)

    @property
    def root(self) -> str:
        """What every path of this database's pages starts with ('' for the only one)."""
        return "" if self.name is None else f"/db/{self.name}"


def picked(request: Request) -> Picked:
    """The database this request works on (set by `sets.PickedDatabase` under `/db/NAME`;
    else the console's only one)."""
    found = getattr(request.state, "picked", None)
    if isinstance(found, Picked):
        return found
    single = request.app.state.single
    if single is None:  # a fleet's page outside /db/NAME: a route wired wrong, not a user's
        raise RuntimeError(f"{request.url.path} is served for no database")
    return single  # type: ignore[no-any-return]


def root(request: Request) -> str:
    """The prefix of the paths of the request's database ('' outside a fleet)."""
    found = getattr(request.state, "picked", None)
    return found.root if isinstance(found, Picked) else ""


def plan_key(request: Request) -> str:
    """What a plan is signed for: the session, and the database it was made on."""
    found = getattr(request.state, "picked", None)
    session = str(request.state.session)
    return session if not isinstance(found, Picked) else f"{session}\ndatabase:{found.name}"
