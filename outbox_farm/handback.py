"""Handing a dead worker's rows back to the queue at once, instead of when their leases expire.

The arbiter does this right after it reaps a worker that did not exit cleanly. It opens one
short-lived connection for it, so it still holds none when it forks the replacement.
"""

from __future__ import annotations

import logging

from .db.leases import release_dead_worker
from .dsn import redact
from .errors import DatabaseError
from .queries import Queries

log = logging.getLogger("outbox_farm.arbiter")
RELEASE_TIMEOUT = 5.0  # seconds the arbiter spends handing back a dead worker's rows


def hand_back(dsn: str, queries: Queries, worker_id: int, pid: int) -> None:
    """Free the rows held by worker `worker_id` (process `pid`, for the log). Best effort: if
    the database cannot be reached, the leases still expire."""
    try:
        released = release_dead_worker(dsn, queries, worker_id, RELEASE_TIMEOUT)
    except DatabaseError as exc:
        log.warning(
            "could not hand back the rows of dead worker %d on %s (%s); they are delivered "
            "again when their leases expire",
            pid,
            redact(dsn),
            str(exc).strip(),
            extra={"event": "release_failed"},
        )
        return
    if released:
        log.info(
            "handed back %d rows held by dead worker %d",
            released,
            pid,
            extra={"event": "leases_released", "rows": released},
        )
