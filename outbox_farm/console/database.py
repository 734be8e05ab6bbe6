"""The console's connections: a few kept open between requests, none shared by two at once.

A page is a handful of short reads; opening a connection for each would cost more than the
reads on a server behind TLS. Up to `KEEP` idle connections are kept; a request takes one (or
opens one), and gives it back only if it came back healthy and outside a transaction. Every
connection is in autocommit mode, as the admin API requires (replay and purge commit batch
by batch). At most `OPEN` are in use at once, whatever the number of requests: the farm's
database is not the console's to crowd. Used from Starlette's thread pool, hence the lock.

Every statement runs under a `statement_timeout` (a page's by default, an action's when
asked): a filter the indexes cannot narrow ends in a "narrow the filter" page, not in a
connection held for minutes. Statements are never prepared server-side: the DLQ filter is one
statement for every combination of fields, and only a plan made for the values given (a
custom plan) can use the index that fits them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..db.connect import Connection, connect, limit_statements
from ..errors import OutboxFarmError

KEEP = 4
OPEN = 8  # connections open at once at most: a console is a few people, not a load test
WAIT = 30.0  # seconds a request waits for one of them before it is refused
IDLE = 0  # psycopg.pq.TransactionStatus.IDLE: no transaction open on the connection


class Database:
    """Connections to the server `url` (named `name` in messages: never the password)."""

    def __init__(self, url: str, name: str, statement_timeout: float = 5.0) -> None:
        self._url, self.name = url, name
        self.statement_timeout = statement_timeout  # seconds; set before serving
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(OPEN)

    @contextmanager
    def connection(self, statement_timeout: float | None = None) -> Iterator[Connection]:
        """A connection of this console for the block, in autocommit mode, its statements
        limited to `statement_timeout` seconds (None: `self.statement_timeout`). Waits up to
        `WAIT` seconds for one of the `OPEN` slots; OutboxFarmError when none frees up."""
        if not self._slots.acquire(timeout=WAIT):
            raise OutboxFarmError(
                f"all {OPEN} of the console's connections stayed busy for {WAIT:.0f}s "
                "(a long replay or purge?); try again in a moment"
            )
        try:
            with self._borrowed() as conn:
                given = statement_timeout
                limit_statements(conn, self.statement_timeout if given is None else given)
                yield conn
        finally:
            self._slots.release()

    @contextmanager
    def _borrowed(self) -> Iterator[Connection]:
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None or conn.closed:
            conn = connect(self._url, autocommit=True, name=self.name)
            conn.prepare_threshold = None  # custom plans only: see the module's docstring
        try:
            yield conn
        except BaseException:
            conn.close()  # whatever state it is in, it is not handed to the next request
            raise
        if conn.broken or conn.closed or conn.info.transaction_status != IDLE:
            conn.close()
            return
        with self._lock:
            if len(self._idle) < KEEP:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
