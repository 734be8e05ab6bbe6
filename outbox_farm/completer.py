"""The completer: every outcome of every executor, written to the table in batches.

Executors hand outcomes over with `put()`; one task flushes them when `flush_size` are
waiting or `flush_interval` after the first one arrived, whichever comes first. A flush is at
most four set-based statements (ack, retry, release, terminal) sent through one pipeline with
a sync after each: statements between two syncs share one implicit transaction, and a failing
DLQ move must not roll back the acks beside it. Every statement matches id and lease token;
rows it did not match are lease_lost, except after a lost connection: a statement sent again
may find its rows gone because its first attempt committed before the reply was lost, and
those are `outcome_unconfirmed`. Once written (or given up on), a row is settled in its
queue's in-flight ledger, which frees its slot.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from .backoff import Backoff
from .inflight import Ledger
from .metrics import metrics
from .outcome import Kind, Outcome
from .problems import Problems
from .queries import Queries

log = logging.getLogger("outbox_farm.completer")


@dataclass
class _Statement:
    phase: str
    query: str
    outcomes: list[Outcome]
    params: dict[str, Any] = field(default_factory=dict)
    resent: bool = False  # in flight when a connection died: it may have committed


class Completer:
    """Batches outcomes into lease-guarded writes.

    State: `_pending` is appended to by executors (`put`) and swapped out by the flush task;
    both run on the one event loop, so no lock is needed.
    """

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        queries: Queries,
        *,
        flush_interval: float = 0.01,
        flush_size: int = 1000,
        high_water: int = 20_000,
        on_retry: Callable[[str, float], None] = lambda queue, delay: None,
        ledgers: Mapping[str, Ledger] | None = None,
        problems: Problems | None = None,
    ) -> None:
        self.pool = pool
        self.queries = queries
        self.flush_interval = flush_interval
        self.flush_size = flush_size
        self.high_water = high_water
        self.on_retry = on_retry
        self.ledgers: Mapping[str, Ledger] = ledgers if ledgers is not None else {}
        self.problems = problems or Problems()
        self._pending: list[Outcome] = []
        self._wake = asyncio.Event()  # set when the first outcome of a batch arrives
        self._full = asyncio.Event()  # set when a batch reached flush_size, or at close
        self._room = asyncio.Event()  # set while the backlog is under high_water
        self._room.set()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._m = metrics()

    # -- executor side -------------------------------------------------------------------

    async def put(self, outcome: Outcome) -> None:
        """Queue an outcome; waits while the completer is `high_water` outcomes behind."""
        while len(self._pending) >= self.high_water:
            self._room.clear()
            await self._room.wait()
        self.put_nowait(outcome)

    def put_nowait(self, outcome: Outcome) -> None:
        """Queue an outcome without waiting (for cancelled executors that cannot wait)."""
        self._pending.append(outcome)
        self._wake.set()
        if len(self._pending) >= self.flush_size:
            self._full.set()

    def flush_now(self) -> None:
        """Write what is waiting without waiting for the interval (a fetcher is out of slots)."""
        if self._pending:
            self._full.set()

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="outbox-farm-completer")

    async def close(self, timeout: float = 30.0) -> None:
        """Final flush of everything queued, then stop. Gives up after `timeout` seconds.

        Outcomes still unwritten then are lost only as writes: their rows keep their leases
        and are delivered again when the leases expire.
        """
        self._closing = True
        self._wake.set()
        self._full.set()
        if self._task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except TimeoutError:
            log.error(
                "completer could not write %d outcomes before the stop deadline; "
                "their rows will be delivered again after their leases expire",
                len(self._pending),
                extra={"event": "flush_abandoned", "outcomes": len(self._pending)},
            )
            self._task.cancel()
            self._failed(self._pending)

    async def _run(self) -> None:
        while True:
            if not self._pending:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            if len(self._pending) < self.flush_size and not self._closing:
                try:
                    async with asyncio.timeout(self.flush_interval):
                        await self._full.wait()
                except TimeoutError:
                    pass
            batch, self._pending = self._pending, []
            self._full.clear()
            self._room.set()
            try:
                await self._flush(batch)
            except Exception:  # a bug here must not stop every later write of the process
                log.exception(
                    "completer failed to write %d outcomes; their rows will be delivered again "
                    "after their leases expire",
                    len(batch),
                    extra={"event": "flush_failed"},
                )
                self._failed(batch)

    def _failed(self, outcomes: list[Outcome]) -> None:
        """Count outcomes given up on without a write (each one is logged by its caller)."""
        counts = Counter((o.kind.value, o.queue) for o in outcomes)
        for (kind, queue), n in counts.items():
            self._m.write_failed.labels(kind, queue).inc(n)

    # -- writing -------------------------------------------------------------------------

    def _statements(self, batch: list[Outcome]) -> list[_Statement]:
        by_kind: dict[Kind, list[Outcome]] = {kind: [] for kind in Kind}
        for outcome in batch:
            by_kind[outcome.kind].append(outcome)
        out: list[_Statement] = []
        q = self.queries
        if by_kind[Kind.ACK]:
            out.append(_Statement("ack", q["ack"], by_kind[Kind.ACK]))
        if by_kind[Kind.RETRY]:
            out.append(_Statement("retry", q["retry"], by_kind[Kind.RETRY]))
        if by_kind[Kind.RELEASE]:
            out.append(_Statement("release", q["release"], by_kind[Kind.RELEASE]))
        if by_kind[Kind.EXPIRE]:
            out.append(_Statement("expire", q["release"], by_kind[Kind.EXPIRE]))
        if by_kind[Kind.TERMINAL]:
            if q.names.dlq is not None:
                out.append(_Statement("terminal", q["dlq_move"], by_kind[Kind.TERMINAL]))
            else:
                out.append(_Statement("terminal", q["ack"], by_kind[Kind.TERMINAL]))
        for stmt in out:
            stmt.params = self._params(stmt)
        return out

    def _params(self, stmt: _Statement) -> dict[str, Any]:
        rows = stmt.outcomes
        params: dict[str, Any] = {
            "ids": [o.row_id for o in rows],
            "tokens": [o.token for o in rows],
        }
        if stmt.phase == "retry":
            params["delays"] = [o.delay for o in rows]
            params["ran"] = [int(o.ran) for o in rows]
            params["started"] = [o.started_at for o in rows]
        elif stmt.phase == "terminal" and self.queries.names.dlq is not None:
            params["reasons"] = [str(o.reason) for o in rows]
            params["exceptions"] = [o.last_exception for o in rows]
        return params

    async def _flush(self, batch: list[Outcome]) -> None:
        """Write a batch; only then do its rows stop counting against their queue's capacity.

        Freeing a slot at hand-over instead would let a worker whose writes are slow hold an
        unbounded number of leased rows, all of which a crash would then deliver again.
        """
        try:
            await self._write(batch)
        finally:
            written: dict[str, list[tuple[int, uuid.UUID]]] = defaultdict(list)
            for outcome in batch:
                written[outcome.queue].append((outcome.row_id, outcome.token))
            for queue, leases in written.items():
                ledger = self.ledgers.get(queue)
                if ledger is not None:
                    ledger.settle_all(leases)

    async def _write(self, batch: list[Outcome]) -> None:
        started = time.perf_counter()
        todo = self._statements(batch)
        backoff = Backoff()
        while todo:
            try:
                async with self.pool.connection() as conn, conn.pipeline() as pipeline:
                    while todo:
                        stmt = todo[0]
                        cursor = conn.cursor()
                        try:
                            await cursor.execute(stmt.query, stmt.params)
                            await pipeline.sync()
                            matched = {(row[0], row[1]) for row in await cursor.fetchall()}
                        except psycopg.Error as exc:
                            if conn.broken or conn.closed:
                                raise
                            todo.pop(0)
                            await self._isolate(stmt, exc)
                            continue
                        unconfirmed = set()
                        if stmt.resent:
                            unconfirmed = await self._unconfirmed(conn, pipeline, stmt, matched)
                        todo.pop(0)
                        self._account(stmt, matched, unconfirmed)
            except (psycopg.OperationalError, psycopg.InterfaceError, OSError) as exc:
                if todo:
                    todo[0].resent = True
                if self._closing and backoff.failures >= 8:
                    log.error(
                        "completer gave up writing at stop: %s",
                        exc,
                        extra={"event": "flush_abandoned"},
                    )
                    self._failed([o for stmt in todo for o in stmt.outcomes])
                    return
                delay = backoff.next()
                log.warning(
                    "completer lost its database connection (%s); retrying in %.2fs",
                    exc,
                    delay,
                    extra={"event": "db_reconnect", "component": "completer"},
                )
                await asyncio.sleep(delay)
        self._m.flush_seconds.observe(time.perf_counter() - started)
        self._m.flush_batch_size.observe(len(batch))

    async def _unconfirmed(
        self,
        conn: psycopg.AsyncConnection[Any],
        pipeline: psycopg.AsyncPipeline,
        stmt: _Statement,
        matched: set[tuple[int, uuid.UUID]],
    ) -> set[int]:
        """Of the rows a re-sent statement did not match, those that are gone or free: the
        first attempt most likely wrote them. The rest are held under another token."""
        missed = [o.row_id for o in stmt.outcomes if (o.row_id, o.token) not in matched]
        if not missed:
            return set()
        cursor = conn.cursor()
        await cursor.execute(self.queries["lease_holders"], {"ids": missed})
        await pipeline.sync()
        held = {row[0] for row in await cursor.fetchall() if row[1] is not None}
        return set(missed) - held

    async def _isolate(self, stmt: _Statement, exc: psycopg.Error) -> None:
        """A statement failed as a whole: write its rows one by one so one bad row stays alone."""
        if len(stmt.outcomes) == 1:
            self._report_failure(stmt, exc)
            return
        for outcome in stmt.outcomes:
            single = _Statement(stmt.phase, stmt.query, [outcome])
            single.params = self._params(single)
            try:
                async with self.pool.connection() as conn:
                    cursor = await conn.execute(single.query, single.params)
                    self._account(single, {(r[0], r[1]) for r in await cursor.fetchall()}, set())
            except psycopg.Error as row_exc:
                self._report_failure(single, row_exc)

    def _report_failure(self, stmt: _Statement, exc: psycopg.Error) -> None:
        outcome = stmt.outcomes[0]
        self._m.write_failed.labels(stmt.phase, outcome.queue).inc()
        fields = {
            "event": "write_failed",
            "phase": stmt.phase,
            "row_id": outcome.row_id,
            "queue": outcome.queue,
        }
        if self.problems.report(f"{stmt.phase} write", exc, log, fields):
            return  # logged, at most once a minute, as the problem it is
        hint = (
            " The DLQ table is missing or does not match: run `outbox-farm check`."
            if stmt.phase == "terminal" and self.queries.names.dlq is not None
            else ""
        )
        log.error(
            "%s write failed for row %s of queue %s: %s. The row stays in the outbox under its "
            "lease and is delivered again when the lease expires.%s",
            stmt.phase,
            outcome.row_id,
            outcome.queue,
            str(exc).strip(),
            hint,
            extra=fields,
        )

    def _account(
        self, stmt: _Statement, matched: set[tuple[int, uuid.UUID]], unconfirmed: set[int]
    ) -> None:
        m = self._m
        phase = stmt.phase
        self.problems.solved(f"{phase} write")
        done: Counter[str] = Counter()
        for outcome in stmt.outcomes:
            if (outcome.row_id, outcome.token) in matched:
                done[outcome.queue] += 1
                if phase == "retry":
                    self.on_retry(outcome.queue, outcome.delay)
                elif phase == "terminal" and self.queries.names.dlq is not None:
                    m.dlq_written.labels(outcome.queue, str(outcome.reason)).inc()
                continue
            if phase == "expire":
                continue  # handed back because its lease ran short: losing it is expected
            fields = {
                "phase": phase,
                "row_id": outcome.row_id,
                "queue": outcome.queue,
                "deliveries_count": outcome.deliveries_count,
            }
            if outcome.row_id in unconfirmed:
                m.outcome_unconfirmed.labels(outcome.queue, phase).inc()
                log.warning(
                    "outcome unconfirmed: the %s of row %s of queue %s was sent again after a "
                    "lost connection and found the row already gone or free; the first attempt "
                    "most likely wrote it",
                    phase,
                    outcome.row_id,
                    outcome.queue,
                    extra={"event": "outcome_unconfirmed", **fields},
                )
                continue
            m.lease_lost.labels(outcome.queue, phase).inc()
            log.warning(
                "lease lost: row %s of queue %s was taken over before its %s was written; "
                "nothing was changed (is the heartbeat off, or was the worker stalled?)",
                outcome.row_id,
                outcome.queue,
                phase,
                extra={"event": "lease_lost", **fields},
            )
        counter = {"ack": m.acked, "retry": m.retried, "release": m.released}.get(phase)
        if counter is not None:
            for queue, n in done.items():
                counter.labels(queue).inc(n)
