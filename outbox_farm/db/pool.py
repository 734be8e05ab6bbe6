"""The runtime's connection pool, and the one connection that proves a DSN works."""

from __future__ import annotations

import asyncio
import time
from types import TracebackType
from typing import Any, TypeAlias
from weakref import WeakKeyDictionary

import orjson
import psycopg
from psycopg.types.json import set_json_loads
from psycopg_pool import AsyncConnectionPool

from ..dsn import check_dsn, redact, scrub
from ..errors import ConfigurationError
from .boundary import boundary
from .claims import JSONB_OID, HeadersLoader
from .connect import CONNECT_TIMEOUT

Pool: TypeAlias = AsyncConnectionPool[Any]
"""What every function of `outbox_farm.db` takes: any `psycopg_pool.AsyncConnectionPool` of
autocommit connections; the blocks that need a transaction open one (`conn.transaction()`)."""

IDLE = psycopg.pq.TransactionStatus.IDLE
OPEN_TIMEOUT = 30.0
CLOSE_TIMEOUT = 0.2  # seconds a pool cancelled while opening waits for its attempts to end


class pooled:
    """A connection of `pool` for one block, given back as the block ends, whatever it raised:
    how every function of `outbox_farm.db` borrows one (the fetchers' statements through
    `Keeper`, which may keep theirs from one claim to the next).

    `pool.connection()` without the connection's own block, which autocommit connections do
    not need: its commit at the end took a lock and a round of the driver's wait loop for
    nothing, and with its generator-based context it cost a claim of one row about 15 µs of
    the event loop, against 6 µs here. A `conn.transaction()` cut short rolls itself back, and
    the pool rolls back a connection given back in a transaction anyway and replaces a broken
    one. A pool that is not autocommit (not one `open_pool` made) gets the connection's block
    all the same, so its writes are committed, not rolled back by the pool."""

    __slots__ = ("_conn", "_pool")
    _conn: psycopg.AsyncConnection[Any]

    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    async def __aenter__(self) -> psycopg.AsyncConnection[Any]:
        self._conn = await self._pool.getconn()
        return self._conn

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        conn = self._conn
        try:
            if not conn.autocommit:
                await conn.__aexit__(kind, exc, tb)
        finally:
            await self._pool.putconn(conn)


class kept(pooled):
    """`pooled`, for a block of a user who may come back soon (`Keeper.use`): its connection
    is the one its key kept, if any, and is kept when `keep` says so and the block ends well,
    on an autocommit connection with no transaction open. Otherwise it goes back to the pool
    as `pooled` gives it back: a block without `keep` (a look before a rest, another
    caller's) leaves nothing kept, so nothing it took is kept past its key's `give_back`."""

    __slots__ = ("_keep", "_keeper", "_key")

    def __init__(self, keeper: Keeper, key: str, keep: bool) -> None:
        super().__init__(keeper.pool)
        self._keeper = keeper
        self._key = key
        self._keep = keep

    async def __aenter__(self) -> psycopg.AsyncConnection[Any]:
        conn = self._keeper.kept.pop(self._key, None)
        if conn is None:
            return await super().__aenter__()
        self._conn = conn
        return conn

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        conn = self._conn
        # Kept, unless a block beside this one kept its own first: then this one goes back.
        if (
            self._keep
            and kind is None
            and conn.autocommit
            and conn.info.transaction_status == IDLE
            and self._keeper.kept.setdefault(self._key, conn) is conn
        ):
            return
        await super().__aexit__(kind, exc, tb)


class Keeper:
    """Connections of `pool` kept between blocks, one per key, each until `give_back`.

    A fetcher's claims come one after another while NOTIFYs keep coming, a few milliseconds
    apart. Kept, a queue's claims skip the checkout and return between the NOTIFY and the
    claim sent, and run on a server process of their own, never one the flushes just used:
    commit → handler at p95 fell at 200 and at 2,000 msg/s in both paired runs of
    `loadtests.bench.tail` (the CPU per message did not move). The fetcher keeps its
    connection only through the short look for the next NOTIFY and gives it back before any
    other wait (`Fetcher._give_back`), so none is kept idle for long."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.kept: dict[str, psycopg.AsyncConnection[Any]] = {}

    def use(self, key: str, *, keep: bool = False) -> kept:
        """A block on the connection `key` kept, or one of the pool's, kept after it when
        `keep` (see `kept`)."""
        return kept(self, key, keep)

    async def give_back(self, key: str) -> None:
        """The connection `key` kept, if any, back to the pool."""
        conn = self.kept.pop(key, None)
        if conn is not None:
            await self.pool.putconn(conn)


KEEP_WARM = 30.0
"""Seconds a pooled connection may go without a use while the pool hands out others: then it
is handed out next (see `RecentFirstPool`)."""


class RecentFirstPool(AsyncConnectionPool[Any]):
    """A pool that hands out the connection given back last, where `AsyncConnectionPool`
    hands out the one idle longest; except that one not handed out for `keep_warm` seconds
    goes first.

    The farm's statements come one or two at a time: round the idle connections in turn, and
    every claim ran on a server process that had slept through the others' statements, its
    caches cold. On the one given back last, an idle farm's commit-to-handler time at the
    median went from 0.54-0.68 to 0.49-0.52 ms (200 msg/s, four alternated pairs).

    But a connection nobody uses for long is one a server's `idle_session_timeout`, a load
    balancer or a NAT may drop: with no check on checkout, the next burst would find it dead,
    or hang on it for the kernel's retransmissions when it went silently. So the connection
    idle longest is still handed out once it has gone `keep_warm` seconds without a use: every
    connection of a pool that is used at all is used at least that often (an idle farm polls
    every half second). The pool's own idle check still closes the connections not needed.

    The order is the pool's own deque's, turned before a checkout (`_get_ready_connection`,
    psycopg_pool 3.2 and later): a psycopg_pool that changes it fails
    `tests/integration/test_pooled_connection.py`, and the pool goes on working as it did
    before."""

    keep_warm = KEEP_WARM

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._handed_at: WeakKeyDictionary[Any, float] = WeakKeyDictionary()

    async def _get_ready_connection(self, timeout: float | None) -> Any:
        idle, now = self._pool, time.monotonic()
        taking = bool(idle) and (timeout is None or timeout > 0.0)
        if taking and now - self._handed_at.get(idle[0], 0.0) < self.keep_warm:
            idle.rotate(1)  # the connection given back last first
        conn = await super()._get_ready_connection(timeout)
        if conn is not None:
            self._handed_at[conn] = now
        return conn


async def _configure(conn: psycopg.AsyncConnection[Any]) -> None:
    set_json_loads(orjson.loads, conn)


async def _configure_farm(conn: psycopg.AsyncConnection[Any]) -> None:
    """`_configure`, for a pool only the farm's own statements use:

    - The session in UTC: the driver then loads a timestamp as a datetime in `datetime.UTC`
      rather than in a `ZoneInfo` of the server's TimeZone, a third of the cost (every claimed
      row has three). The statements' only use of the zone is the text of a timestamp a client
      cannot load (the claim's `unloadable`, which the DLQ keeps): in UTC too. A user's
      transaction keeps the server's zone.
    - The claims' headers loader (`claims.HeadersLoader`) on the connection, not on each
      claim's cursor (`claims.claim_cursor`). No other statement of the farm's asks for
      results in binary, so it loads nothing else.
    - No sequential scan where an index can answer (`enable_seqscan` off). Every statement of
      the farm's hot path finds its rows by an index (ids by the primary key, due rows by the
      pending index), and each is prepared once and run on its cached plan. A plan made while
      the table was small (a new table; one autovacuum truncated, then analyzed) read the whole
      table for the ids a claim or an ack names, and went on reading it as dead rows grew it
      until the next VACUUM or ANALYZE: on an idle farm's churning table, up to half of a
      claim's time. The statements that do count whole tables (the gauges) turn it back on
      for their own transaction (`housekeeping.scanning`)."""
    await _configure(conn)
    conn.adapters.register_loader(JSONB_OID, HeadersLoader)
    await conn.execute("SET TimeZone = 'UTC'")
    await conn.execute("SET enable_seqscan = off")


async def open_pool(dsn: str, max_size: int, *, farm: bool = False) -> Pool:
    """Open the runtime's pool of at most `max_size` autocommit connections, once its first
    connection works (ConnectionLost after 30 s otherwise). The caller closes it. `farm`: the
    sessions set for the farm's own statements (see `_configure_farm`), for a pool only they
    use.

    No check on checkout: it would cost a round trip per statement, and a pool `check=` made
    psycopg_pool sleep seconds per dead connection after a restart. Every user of the pool
    retries on `ConnectionLost`, and the pool discards connections that come back broken.
    """
    pool = RecentFirstPool(
        dsn,
        min_size=1,
        max_size=max_size,
        # A connection attempt to a server that does not answer ends at the timeout rather
        # than the driver's default of minutes, so a stop never waits on one for long.
        kwargs={"autocommit": True, "connect_timeout": CONNECT_TIMEOUT},
        configure=_configure_farm if farm else _configure,
        open=False,
        name="outbox-farm",
    )
    try:
        with boundary():
            await pool.open(wait=True, timeout=OPEN_TIMEOUT)  # closes the pool on a timeout
    except asyncio.CancelledError:
        # A stop during the open: the pool's connection attempts are tasks of their own, which
        # would retry for ever (and keep the worker's event loop from ending) unless closed.
        await pool.close(timeout=CLOSE_TIMEOUT)
        raise
    return pool


async def probe(dsn: str, timeout: float = 10.0) -> None:
    """Connect once, so a wrong DSN fails at start with a clear message, not in a retry loop;
    the message masks every fragment of the DSN's secret, libpq's quotes of it included."""
    check_dsn(dsn)
    try:
        conn = await psycopg.AsyncConnection.connect(dsn, connect_timeout=max(int(timeout), 1))
    except psycopg.Error as exc:
        message = (
            f"cannot connect to {redact(dsn)}: {str(exc).strip()}. Check --dsn / "
            "OUTBOX_FARM_DSN (or the file of --dsn-file), and that the server is running and "
            "reachable."
        )
        raise ConfigurationError(scrub(message, dsn)) from None
    await conn.close()
