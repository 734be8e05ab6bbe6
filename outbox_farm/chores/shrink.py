"""Gives an outbox table's space back once a backlog is gone and the table is quiet.

VACUUM frees a deleted row's space for reuse and keeps it in the files: after a backlog of
10,000,000 rows the table and its indexes held 1.5 GiB, 99.6% of it free, for a table that
holds a handful of rows. The next backlog reuses that space, so it does the farm no harm, but
it is disk the operator sees gone, that backups carry and replicas replay, and a B-tree never
gives a page back by itself. So after each pass of the vacuum loop (same process, same
interval) the farm looks at the table's size and at the rows inserted into it since the last
pass, and shrinks it when all of these hold:

- the table with its indexes takes at least `SHRINK_AT` bytes;
- it is quiet: the rows inserted in the last interval, and then its live rows (counted up to
  the number that would fail the test, so a count is cheap whatever the table holds), come to
  fewer than one for every `QUIET` pages of its files. A busy table never qualifies, however
  empty it is between passes: at 20,000 msg/s a table of a few hundred MB holds a few hundred
  live rows at any moment, refills its free space within one interval, and a shrink there
  (truncations fighting every claim and publish for the table's lock, indexes rebuilt under
  the load) stalled claims for seconds in a sustained run. Without the server's statistics
  (track_counts off) nothing says how busy it is, and the farm never shrinks it.

The shrink itself:

- it drops what an earlier rebuild cut short left behind (see `Relation.kind`);
- a truncating VACUUM gives the empty tail of the table back (the lock that takes is never
  waited for, and let go within about 20 ms of anyone asking: see `shrink_vacuum`);
- each index holding fewer than `INDEX_ROWS_PER_PAGE` live entries a page (a packed one holds
  a hundred or more) is rebuilt with REINDEX CONCURRENTLY, which lets claims, acks and
  publishes go on.

Only one session shrinks a table at a time (an advisory lock), and each statement waits at
most `LOCK_TIMEOUT` for a lock. A big table is looked at again after twice the passes of the
time before, up to `MAX_GAP`, whether it was found busy or full (a standing backlog is not
counted at every pass) or it is still big after a shrink (its last live row at the end of the
file, say: not rebuilt at every pass). Leftovers are dropped at every pass that finds them:
writes keep maintaining them.
"""

from __future__ import annotations

import logging
import time

from ..db import housekeeping
from ..db.housekeeping import Relation, Shrunk
from ..db.pool import Pool
from ..metrics import metrics
from ..queries import Queries

log = logging.getLogger("outbox_farm.shrink")

SHRINK_AT = 64 * 2**20  # bytes the table with its indexes takes before it is worth a look
QUIET = 8  # pages of the files, at least, for each row inserted last interval or live
INDEX_ROWS_PER_PAGE = 16  # live entries an index page holds on average, below which it is rebuilt
INDEX_PAGES = 8  # an index of this many pages or fewer is never rebuilt: nothing to win
LOCK_TIMEOUT = 5.0  # seconds each statement of a shrink waits for a lock
MAX_GAP = 16  # passes at most between two looks at a big table
MIB = 2**20


def loose(index: Relation, live_rows: int) -> bool:
    """Whether a rebuild would make `index` much smaller."""
    return index.pages > INDEX_PAGES and live_rows < index.pages * INDEX_ROWS_PER_PAGE


class Shrinker:
    """The shrink pass of one vacuum loop, which keeps the wait before the next look and the
    table's inserts at the last pass."""

    def __init__(self, pool: Pool, queries: Queries, interval: float) -> None:
        self.pool = pool
        self.queries = queries
        self.interval = interval
        self.gap = 1  # passes from one look at a big table to the next
        self.next_at = 0.0  # monotonic time of the next look at a big table
        self.last: tuple[int, float] | None = None  # inserts counted, and when (monotonic)

    def _churn(self, inserted: int | None, now: float) -> float | None:
        """Rows inserted per interval since the last pass; None when unknown (the first pass,
        a reset of the statistics, or none kept)."""
        last, self.last = self.last, None if inserted is None else (inserted, now)
        if inserted is None or last is None or inserted < last[0]:
            return None
        return (inserted - last[0]) * self.interval / max(now - last[1], self.interval, 1e-3)

    async def once(self) -> Shrunk | None:
        """Shrink the table if it is big, quiet and due a look, or drop leftovers alone; what
        was done, or None when nothing was."""
        state = await housekeeping.shrink_state(self.pool, self.queries)
        now = time.monotonic()
        churn = self._churn(state.inserted, now)
        kept = [r for r in state.relations if r.kind != "leftover"]
        leftovers = [r for r in state.relations if r.kind == "leftover"]
        rebuild: list[Relation] = []
        live: int | None = None
        if sum(r.size for r in kept) < SHRINK_AT:
            self.gap, self.next_at = 1, 0.0
        elif churn is not None and now >= self.next_at:
            self.next_at = now + self.gap * self.interval
            self.gap = min(self.gap * 2, MAX_GAP)
            room = sum(r.pages for r in kept) // QUIET - int(churn)  # rows a quiet table holds
            if room > 0:
                live = await housekeeping.live_rows(self.pool, self.queries, room)
                if live < room:
                    rebuild = [r for r in kept if r.kind == "index" and loose(r, live)]
                else:
                    live = None  # busy or full: nothing to shrink
        if live is None and not leftovers:
            return None
        started = time.perf_counter()
        shrunk = await housekeeping.shrink(
            self.pool, self.queries, rebuild, leftovers, LOCK_TIMEOUT
        )
        if not shrunk.locked:
            after = await housekeeping.shrink_state(self.pool, self.queries)
            self._report(
                state.relations, after.relations, live, shrunk, time.perf_counter() - started
            )
        return shrunk

    def _report(
        self,
        before: list[Relation],
        after: list[Relation],
        live: int | None,
        shrunk: Shrunk,
        seconds: float,
    ) -> None:
        table = self.queries.names.outbox
        was, now = (sum(r.size for r in relations) for relations in (before, after))
        metrics().shrinks.inc()
        metrics().shrunk_bytes.inc(max(was - now, 0))
        log.info(
            "shrank %s and its indexes from %.1f to %.1f MiB in %.1f s (%s live rows): %s",
            table,
            was / MIB,
            now / MIB,
            seconds,
            "uncounted" if live is None else live,
            "; ".join(_said(shrunk)),
            extra={
                "event": "table_shrunk",
                "bytes_before": was,
                "bytes_after": now,
                "rebuilt": shrunk.rebuilt,
                "dropped": shrunk.dropped,
            },
        )
        for index, why in shrunk.failed:
            log.warning(
                "could not rebuild or drop index %s of %s (%s); tried again at the next shrink",
                index,
                table,
                why,
                extra={"event": "shrink_failed", "index": index},
            )


def _said(shrunk: Shrunk) -> list[str]:
    """What a shrink did, in words."""
    said = [
        "the table's tail kept (someone held the table)"
        if shrunk.vacuum_skipped
        else "the table's empty tail given back"
    ]
    if shrunk.rebuilt:
        said.append("rebuilt " + ", ".join(shrunk.rebuilt))
    if shrunk.dropped:
        said.append("dropped the leftovers " + ", ".join(shrunk.dropped))
    return said
