"""Rows a claim took that no client can load, on a farm with no DLQ to keep them: set aside.

Its own module because it is the one place a claim's rows are not handed to the executors:
which rows that is, and parking them (`Store.set_aside`), each reported, happen before any
handler could see them, whichever claim took them (the loop's, the breaker's probe, a
hand-over). Its lines keep the fetcher's logger: to whoever filters logs by logger they are
the fetcher's claims.
"""

from __future__ import annotations

import logging
import uuid

from ...message import Message
from ...metrics import metrics
from ...storage import Store

log = logging.getLogger("outbox_farm.fetcher")
SET_ASIDE_SECONDS = 3600.0
"""How long a row set aside stays so before it is claimed (and reported) again: often enough
that the warning is not forgotten, seldom enough not to flood the log."""


def unloadable(msgs: list[Message], max_deliveries: int | None) -> list[Message]:
    """The rows of `msgs` to set aside: those the claim could not load (`invalid`), while
    within `max_deliveries`, which holds for them as for any row."""
    return [
        msg
        for msg in msgs
        if msg.invalid is not None
        and (max_deliveries is None or msg.deliveries_count <= max_deliveries)
    ]


async def set_aside(store: Store, queue: str, msgs: list[Message], token: uuid.UUID) -> None:
    """Park rows of `queue` held under `token` that can be neither loaded nor dead-lettered
    (see `Store.set_aside`), each reported by id: a WARNING `row_set_aside` and
    `outbox_farm_set_aside_total`."""
    ids = [msg.id for msg in msgs]
    parked = set(await store.set_aside(ids, token, SET_ASIDE_SECONDS))
    for row_id, why in ((msg.id, msg.invalid) for msg in msgs):
        if row_id not in parked:
            continue  # taken over by another lease meanwhile: that runner reports it
        log.warning(
            "row %s of queue %s cannot be loaded (%s) and there is no DLQ to keep it: set "
            "aside for %gs, then claimed and reported again (fix or delete it by hand)",
            row_id,
            queue,
            why,
            SET_ASIDE_SECONDS,
            extra={"event": "row_set_aside", "row_id": row_id, "queue": queue, "why": why},
        )
    if parked:
        metrics().set_aside.labels(queue).inc(len(parked))
