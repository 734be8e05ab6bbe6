"""The probe of a queue's open breaker, as its fetcher claims it: one row, when this process
wins the probe's turn (one process of one host wins each interval), and only once its last
probe ended.

Its own module because the turn is the breaker's, not the claims': when a probe may go
(`probe_wait`), and the turn asked for and its row claimed (`probe`), each with its own
bookkeeping in the breaker (`QueueBreaker.probes`, `probed`). The fetcher's loop decides only
that the breaker is open, and takes the row. Its lines keep the fetcher's logger: to whoever
filters logs by logger they are the fetcher's claims.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection

from ...errors import DatabaseError
from ...message import Message
from ...storage import Claim, Store
from ..breaker import QueueBreaker

log = logging.getLogger("outbox_farm.fetcher")


def probe_wait(breaker: QueueBreaker, held: Collection[int]) -> float | None:
    """Seconds to wait before the next probe, None when it may go now. Its last probe ended
    once its row is no longer among the rows `held`: a probe written without a run (past
    `max_deliveries`, say) is over too."""
    breaker.probes.intersection_update(held)
    wait = breaker.probe_at - time.monotonic()
    if breaker.probes or wait > 0:
        return wait if wait > 0 else breaker.breaker.probe_every
    return None


async def probe(
    store: Store, breaker: QueueBreaker, new_claim: Callable[[int], Claim]
) -> tuple[Claim, list[Message]] | None:
    """The probe's claim (made by `new_claim`, once the turn is won) and the row it took, for
    the fetcher to take; None when another process won the turn. A refused turn or claim
    leaves the probe to the next interval."""
    queue = breaker.queue
    try:
        won = await store.breaker_probe(queue, breaker.breaker.probe_every)
        breaker.probed(won)
        if not won:
            return None
        claim = new_claim(1)
        msgs = await store.claim(claim)
    except DatabaseError as exc:
        log.debug("probe of queue %s not claimed (%s)", queue, exc)
        breaker.probed(False)
        return None
    breaker.probes.update(msg.id for msg in msgs)
    if msgs:
        log.info(
            "probing queue %s's downstream with row %s",
            queue,
            msgs[0].id,
            extra={"event": "breaker_probe", "queue": queue, "row_id": msgs[0].id},
        )
    return claim, msgs
