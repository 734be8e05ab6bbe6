"""Gives an outbox table's space back once a backlog is gone and the table is quiet.

VACUUM frees a deleted row's space for reuse and keeps it in the files: after a backlog of
10,000,000 rows the table and its indexes held 1.5 GiB, 99.6% of it free, for a table that
holds a handful of rows. The next backlog reuses that space, so it does the farm no harm, but
it is disk the operator sees gone, that backups carry and replicas replay, and a B-tree never
gives a page back by itself. So after each pass of the vacuum loop (same process, same
interval) the farm looks at the table's size and at the rows inserted into it since the last
pass (the statistics' count, over the time between the passes), and shrinks it when:

- the table with its indexes takes at least `SHRINK_AT` bytes;
- it was quiet at this pass and the one before: at most `QUIET_RATE` rows inserted a second,
  and, with `WINDOW` seconds of those rows and then its live rows (counted up to the number that
  would fail the test, so a count is cheap whatever the table holds), fewer rows than one for
  every `QUIET` pages of its files. A busy table never qualifies, however empty it is between
  passes: at 20,000 msg/s a table of a few hundred MB holds a few hundred live rows at any
  moment and refills its free space within seconds, and a shrink there (truncations fighting
  every claim and publish for the table's lock, indexes rebuilt under the load) stalled claims
  for seconds in a sustained run. Two passes, since the statistics of a busy session reach the
  server up to a second late. Without the statistics (track_counts off) nothing says how busy
  the table is, and the farm never shrinks it.

The shrink itself:

- it drops what an earlier rebuild cut short left behind (see `Relation.kind`);
- a truncating VACUUM gives the empty tail of the table back (the lock that takes is never
  waited for, and given up when anyone asks: see `shrink_vacuum`);
- each index holding fewer than `INDEX_ROWS_PER_PAGE` live entries a page (a packed one holds
  a hundred or more) is rebuilt with REINDEX CONCURRENTLY, which lets claims, acks and
  publishes go on; not a unique index other than the primary key (see `shrink_state`).

Only one session shrinks a table at a time (an advisory lock); the drops and the VACUUM wait at
most `LOCK_TIMEOUT` for a lock, and each rebuild, whose waits for older transactions a lock
timeout would cut after the build, at most `REBUILD_TIMEOUT` in all. A big table is counted
again only after twice the passes of the time before, up to `MAX_GAP`, whether it was found
full (a standing backlog is not counted at every quiet pass) or it is still big after a shrink
(its last live row at the end of the file, say: not rebuilt at every pass). Leftovers are
dropped, and nothing else done, at any pass that finds them: writes keep maintaining them. A
drop or rebuild that fails is logged once per index (then at DEBUG), so a cause that lasts (a
long transaction, a missing privilege) does not fill the log.
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
QUIET = 8  # pages of the files, at least, for each live row or row of the last WINDOW seconds
QUIET_RATE = 1000.0  # rows inserted a second, at most, into a quiet table
WINDOW = 10.0  # seconds of inserts a quiet table has room for beside its live rows
REBUILD_TIMEOUT = 600.0  # seconds one rebuild may take in all, its waits included
INDEX_ROWS_PER_PAGE = 16  # live entries an index page holds on average, below which it is rebuilt
INDEX_PAGES = 8  # an index of this many pages or fewer is never rebuilt: nothing to win
LOCK_TIMEOUT = 5.0  # seconds each statement of a shrink waits for a lock
MAX_GAP = 16  # passes at most between two looks at a big table
MIB = 2**20


def loose(index: Relation, live_rows: int) -> bool:
    """Whether a rebuild would make `index` much smaller."""
    return index.pages > INDEX_PAGES and live_rows < index.pages * INDEX_ROWS_PER_PAGE


class Shrinker:
    """The shrink pass of one vacuum loop, which keeps what the next pass needs: the wait
    before the next count, the table's inserts at this pass, whether it was quiet, and the
    indexes whose failure is already logged."""

    def __init__(self, pool: Pool, queries: Queries, interval: float) -> None:
        self.pool = pool
        self.queries = queries
        self.interval = interval
        self.gap = 1  # passes from one count of a big table to the next
        self.next_at = 0.0  # monotonic time of the next count of a big table
        self.last: tuple[int, float] | None = None  # inserts counted, and when (monotonic)
        self.quiet = False  # at the last pass
        self.warned: set[str] = set()

    def _rate(self, inserted: int | None, now: float) -> float | None:
        """Rows inserted a second since the last pass; None when unknown (the first pass, a
        reset of the statistics, or none kept)."""
        last, self.last = self.last, None if inserted is None else (inserted, now)
        if inserted is None or last is None or inserted < last[0]:
            return None
        return (inserted - last[0]) / max(now - last[1], 1e-3)

    async def once(self) -> Shrunk | None:
        """Shrink the table if it is big, quiet and due a count, or drop leftovers alone; what
        was done, or None when nothing was."""
        state = await housekeeping.shrink_state(self.pool, self.queries)
        now = time.monotonic()
        rate = self._rate(state.inserted, now)
        kept = [r for r in state.relations if r.kind != "leftover"]
        leftovers = [r for r in state.relations if r.kind == "leftover"]
        pages = sum(r.pages for r in kept)
        room = pages // QUIET - int((rate or 0.0) * WINDOW)  # live rows a quiet table may hold
        quiet, was_quiet = rate is not None and rate <= QUIET_RATE and room > 0, self.quiet
        self.quiet = quiet
        rebuild: list[Relation] = []
        live: int | None = None
        if sum(r.size for r in kept) < SHRINK_AT:
            self.gap, self.next_at = 1, 0.0
        elif quiet and was_quiet and now >= self.next_at:
            self.next_at = now + self.gap * self.interval
            self.gap = min(self.gap * 2, MAX_GAP)
            live = await housekeeping.live_rows(self.pool, self.queries, room)
            if live < room:
                rebuild = [r for r in kept if r.kind == "index" and loose(r, live)]
            else:
                live = None  # full: nothing to shrink
        if live is None and not leftovers:
            return None
        started = time.perf_counter()
        shrunk = await housekeeping.shrink(
            self.pool,
            self.queries,
            rebuild,
            leftovers,
            vacuum=live is not None,
            lock_timeout=LOCK_TIMEOUT,
            rebuild_timeout=REBUILD_TIMEOUT,
        )
        if not shrunk.locked:
            after = await housekeeping.shrink_state(self.pool, self.queries)
            seconds = time.perf_counter() - started
            self._report(state.relations, after.relations, live, shrunk, seconds)
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
        said = []
        if live is not None:
            given = before[0].size - after[0].size
            said.append(
                f"the table's empty tail given back ({given / MIB:.1f} MiB)"
                if given > 0
                else "no empty tail to give back"
                + (" (someone held the table)" if shrunk.vacuum_skipped else "")
            )
        if shrunk.rebuilt:
            said.append("rebuilt " + ", ".join(shrunk.rebuilt))
        if shrunk.dropped:
            said.append("dropped the leftovers " + ", ".join(shrunk.dropped))
        log.info(
            "shrank %s and its indexes from %.1f to %.1f MiB in %.1f s (%s live rows): %s",
            table,
            was / MIB,
            now / MIB,
            seconds,
            "uncounted" if live is None else live,
            "; ".join(said) or "nothing to do",
            extra={
                "event": "table_shrunk",
                "bytes_before": was,
                "bytes_after": now,
                "rebuilt": shrunk.rebuilt,
                "dropped": shrunk.dropped,
            },
        )
        for index, why in shrunk.failed:
            first = index not in self.warned
            self.warned.add(index)
            log.log(
                logging.WARNING if first else logging.DEBUG,
                "could not rebuild or drop index %s of %s (%s); tried again at the next shrink%s",
                index,
                table,
                why,
                " (said once: DEBUG from now on)" if first else "",
                extra={"event": "shrink_failed", "index": index},
            )
