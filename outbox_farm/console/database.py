"""The console's connections: a few kept open between requests, none shared by two at once.

A page is a handful of short reads; opening a connection for each would cost more than the
reads on a server behind TLS. Up to `KEEP` idle connections are kept; a request takes one (or
opens one), and gives it back only if it came back healthy and outside a transaction. Every
connection is in autocommit mode, as the admin API requires (replay and purge commit batch
by batch). At most `OPEN` are in use at once, whatever the number of requests: the farm's
database is not the console's to crowd. Used from Starlette's thread pool, hence the lock.

A console over a fleet's set has one `Budget` for every database of it: `OPEN` in use and
`KEEP` idle across the whole set (the oldest idle one closed first), and an idle connection
closed after `IDLE_FOR` seconds by `Budget.sweep`. A set of 500 databases never holds 500
pools: a page of one database opens one connection to it, and the next page of another
database closes it when the budget is full.

Every statement runs under a `statement_timeout` (a page's by default, an action's when
asked): a filter the indexes cannot narrow ends in a "narrow the filter" page, not in a
connection held for minutes. Statements are never prepared server-side: the DLQ filter is one
statement for every combination of fields, and only a plan made for the values given (a
custom plan) can use the index that fits them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ..db.boundary import boundary
from ..db.connect import Connection, bounded, connect, limit_statements
from ..dsn import scrub
from ..errors import ConnectionLost, OutboxFarmError

KEEP = 4
OPEN = 8  # connections open at once at most: a console is a few people, not a load test
WAIT = 30.0  # seconds a request waits for one of them before it is refused
IDLE = 0  # psycopg.pq.TransactionStatus.IDLE: no transaction open on the connection
IDLE_FOR = 60.0  # seconds an idle connection of a set's database is kept


class Budget:
    """The connections one console may hold, whatever databases they go to: at most `open`
    in use, at most `keep` idle (the oldest closed first when another is given back)."""

    def __init__(self, open: int = OPEN, keep: int = KEEP, idle_for: float | None = None) -> None:
        self.open, self.keep, self.idle_for = open, keep, idle_for
        self.slots = threading.BoundedSemaphore(open)
        self._lock = threading.Lock()
        self._idle: list[tuple[object, Connection, float]] = []  # (owner, conn, since)

    def take(self, owner: object) -> Connection | None:
        """An idle connection of `owner`'s (the most recently given back), or None."""
        with self._lock:
            for index in range(len(self._idle) - 1, -1, -1):
                if self._idle[index][0] is owner:
                    return self._idle.pop(index)[1]
        return None

    def give(self, owner: object, conn: Connection) -> None:
        """Keep `conn` idle for `owner`; the oldest idle connection is closed past `keep`."""
        with self._lock:
            self._idle.append((owner, conn, time.monotonic()))
            excess = self._idle[: max(len(self._idle) - self.keep, 0)]
            del self._idle[: len(excess)]
        for _, old, _ in excess:
            old.close()

    def sweep(self, now: float | None = None) -> int:
        """Close the connections idle for more than `idle_for` seconds; how many."""
        if self.idle_for is None:
            return 0
        at = time.monotonic() if now is None else now
        with self._lock:
            stale = [entry for entry in self._idle if at - entry[2] > self.idle_for]
            self._idle = [entry for entry in self._idle if at - entry[2] <= self.idle_for]
        for _, conn, _ in stale:
            conn.close()
        return len(stale)

    def drop(self, owner: object | None = None) -> None:
        """Close the idle connections of `owner` (None: every one)."""
        with self._lock:
            gone = [e for e in self._idle if owner is None or e[0] is owner]
            self._idle = [e for e in self._idle if not (owner is None or e[0] is owner)]
        for _, conn, _ in gone:
            conn.close()

    @property
    def idle(self) -> int:
        """Connections kept idle now (for tests and the log)."""
        with self._lock:
            return len(self._idle)


class Database:
    """Connections to the server `url` (named `name` in messages: never the password), drawn
    from `budget` (one of its own when none is given: a console of one database)."""

    def __init__(
        self,
        url: str,
        name: str,
        statement_timeout: float = 5.0,
        *,
        budget: Budget | None = None,
        connect_timeout: int | None = None,
    ) -> None:
        self._url, self.name = url, name
        self.statement_timeout = statement_timeout  # seconds; set before serving
        self.budget = budget if budget is not None else Budget()
        self.connect_timeout = connect_timeout  # seconds (libpq's: 2 at least); None: libpq's

    @contextmanager
    def connection(
        self, statement_timeout: float | None = None, wait: float = WAIT
    ) -> Iterator[Connection]:
        """A connection of this console for the block, in autocommit mode, its statements
        limited to `statement_timeout` seconds (None: `self.statement_timeout`). Waits up to
        `wait` seconds for one of the budget's slots; OutboxFarmError when none frees up."""
        if not self.budget.slots.acquire(timeout=wait):
            raise OutboxFarmError(
                f"all {self.budget.open} of the console's connections stayed busy for "
                f"{wait:.0f}s (a long replay or purge?); try again in a moment"
            )
        try:
            with self._borrowed() as conn:
                given = statement_timeout
                limit_statements(conn, self.statement_timeout if given is None else given)
                yield conn
        finally:
            self.budget.slots.release()

    def _open(self) -> Connection:
        if self.connect_timeout is None:
            return connect(self._url, autocommit=True, name=self.name)
        try:
            with boundary():  # the driver's errors as outbox_farm's: ConnectionLost here
                return bounded(self._url, max(2, self.connect_timeout))
        except ConnectionLost as exc:
            message = f"cannot connect to database {self.name}: {str(exc).strip()}"
            raise ConnectionLost(scrub(message, self._url)) from exc

    @contextmanager
    def _borrowed(self) -> Iterator[Connection]:
        conn = self.budget.take(self)
        if conn is None or conn.closed:
            conn = self._open()
            conn.prepare_threshold = None  # custom plans only: see the module's docstring
        try:
            yield conn
        except BaseException:
            conn.close()  # whatever state it is in, it is not handed to the next request
            raise
        if conn.broken or conn.closed or conn.info.transaction_status != IDLE:
            conn.close()
            return
        self.budget.give(self, conn)

    def close(self) -> None:
        """Close this database's idle connections."""
        self.budget.drop(self)
