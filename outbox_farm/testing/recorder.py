"""A farm without a database, for unit tests: publishes kept in memory, handlers run on them.

`record(farm)` swaps the farm's publish calls for ones that check and encode exactly as the
real ones do (a bad call fails the same way) and keep the rows here instead of writing them;
the connection argument is not used, so a test may pass None. `Recorder.run()` then runs the
handlers on the recorded rows under the runtime's own rulebook, asked as the executors ask it
(`decision.before_run`, then `decision.decide`): retries, `max_deliveries`, manual acks,
middleware, `on_failure`, per-key order. What it cannot be is a database: transactional
handlers (they need a connection) are refused, and the lease and the heartbeat have no meaning
here. Handlers are called exactly as the executor calls them (`outbox_farm.worker.invoke`):
behind their middleware, a plain function in a thread, under their timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson

from .. import decision
from ..db.publish import NewRow
from ..errors import ConfigurationError
from ..farm import Farm
from ..handler import HandlerSpec
from ..message import Message
from ..outcome import Kind, Outcome
from ..worker.invoke import call_path, on_failure, timed_out
from .results import Collector, Drained

log = logging.getLogger("outbox_farm.testing")

_CALLS = ("publish", "apublish", "publish_batch", "apublish_batch", "cancel_timer", "acancel_timer")


@dataclass
class _Row:
    """A recorded row: what the outbox table would hold."""

    id: int
    queue: str
    body: bytes
    headers: dict[str, Any]
    created_at: float
    due_at: float
    timer_id: str | None
    ordering_key: str | None
    deliveries_count: int = 0
    attempts_count: int = 0
    first_attempt_at: float | None = None

    def message(self, now: float) -> Message:
        return Message(
            id=self.id,
            queue=self.queue,
            body=self.body,
            headers=dict(self.headers),
            deliveries_count=self.deliveries_count,
            attempts_count=self.attempts_count,
            created_at=_at(self.created_at),
            next_attempt_at=_at(self.due_at),
            first_attempt_at=(
                _at(self.first_attempt_at) if self.first_attempt_at is not None else None
            ),
            timer_id=self.timer_id,
            lease_token=uuid.uuid4(),
            claimed_at=_at(now),
            ordering_key=self.ordering_key,
            claimed_epoch=now,
            due_epoch=self.due_at,
        )


def _at(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


class Recorder:
    """The memory outbox of one farm, with a clock of its own (it moves only when `run` is
    told to look ahead, so a test never sleeps).

    `published(queue=...)`: every message published, handled or not, oldest first.
    `pending(queue=...)`: those still waiting. `dead_letters`: the runs that ended in the DLQ.
    """

    def __init__(self, farm: Farm) -> None:
        self.farm = farm
        self.now = time.time()
        self._ids = itertools.count(1)
        self._published: list[_Row] = []
        self._outbox: dict[int, _Row] = {}
        self.dead_letters: list[Message] = []

    # -- what the farm's publish calls become --------------------------------------------

    def publish(self, conn: object, body: object, **options: Any) -> int | None:
        row, _ = self.farm.producer.build_row(body, **options)
        return self._insert(row)

    async def apublish(self, conn: object, body: object, **options: Any) -> int | None:
        return self.publish(conn, body, **options)

    def publish_batch(self, conn: object, bodies: Sequence[object], **options: Any) -> list[int]:
        batch, _ = self.farm.producer.build_batch(bodies, **options)
        keys = batch.ordering_keys or [None] * len(batch.payloads)
        ids = []
        for payload, headers, key in zip(batch.payloads, batch.headers, keys, strict=True):
            row = NewRow(batch.queue, payload, headers, batch.due, ordering_key=key)
            ids.append(self._insert(row))
        return [i for i in ids if i is not None]

    async def apublish_batch(
        self, conn: object, bodies: Sequence[object], **options: Any
    ) -> list[int]:
        return self.publish_batch(conn, bodies, **options)

    def cancel_timer(self, conn: object, *, queue: str, timer_id: str) -> bool:
        live = self._timer(queue, timer_id)
        if live is None:
            return False
        del self._outbox[live.id]
        return True

    async def acancel_timer(self, conn: object, *, queue: str, timer_id: str) -> bool:
        return self.cancel_timer(conn, queue=queue, timer_id=timer_id)

    def _insert(self, new: NewRow) -> int | None:
        due = new.due.at.timestamp() if new.due.at is not None else self.now + new.due.delay
        if new.timer_id is not None and (live := self._timer(new.queue, new.timer_id)):
            if not new.extend_timer:
                return None
            live.due_at = due
            return live.id
        row = _Row(
            next(self._ids),
            new.queue,
            new.payload,
            orjson.loads(new.headers),
            self.now,
            due,
            new.timer_id,
            new.ordering_key,
        )
        self._published.append(row)
        self._outbox[row.id] = row
        return row.id

    def _timer(self, queue: str, timer_id: str) -> _Row | None:
        for row in self._outbox.values():
            if row.queue == queue and row.timer_id == timer_id:
                return row
        return None

    # -- what a test asserts on ------------------------------------------------------------

    def published(self, queue: str | None = None) -> list[Message]:
        return [r.message(self.now) for r in self._published if queue in (None, r.queue)]

    def pending(self, queue: str | None = None) -> list[Message]:
        return [r.message(self.now) for r in self._outbox.values() if queue in (None, r.queue)]

    def clear(self) -> None:
        """Forget every message, published or pending, and the dead letters."""
        self._published.clear()
        self._outbox.clear()
        self.dead_letters.clear()

    # -- running the handlers ------------------------------------------------------------

    def run(
        self, *, queues: Iterable[str] | None = None, within: float = 0.0, limit: int = 100_000
    ) -> Drained:
        """Run the handlers on every due message, one at a time (a batch at a time for a batch
        handler), until none is due; `within` moves the clock to run what falls due in the next
        so many seconds; `limit` stops after that many verdicts. As `drain`, without a
        database; from a coroutine, await `arun`."""
        return asyncio.run(self.arun(queues=queues, within=within, limit=limit))

    async def arun(
        self, *, queues: Iterable[str] | None = None, within: float = 0.0, limit: int = 100_000
    ) -> Drained:
        specs = self._specs(queues)
        collector = Collector()
        start = self.now
        while len(collector.runs) < limit:
            due = self._due(specs)
            if due:
                for spec, rows in due:
                    await self._run(spec, rows, collector)
                continue
            waiting = [r.due_at for r in self._runnable(specs)]
            if not waiting or min(waiting) - start > within:
                break
            self.now = max(self.now, min(waiting))
        left = sum(1 for r in self._outbox.values() if r.queue in specs)
        return Drained(collector.runs, left, self.now - start)

    def _specs(self, queues: Iterable[str] | None) -> dict[str, HandlerSpec]:
        handlers = self.farm.handlers
        names = list(handlers) if queues is None else list(queues)
        unknown = sorted(set(names) - set(handlers))
        if unknown:
            raise ConfigurationError(f"no handler registered for queues {unknown}")
        specs = {q: handlers[q] for q in names}
        for spec in specs.values():
            if spec.transactional:
                raise ConfigurationError(
                    f"queue {spec.queue!r} has a transactional handler, which needs a database "
                    "connection: test it with outbox_farm.testing.drain and the outbox_dsn "
                    "fixture instead"
                )
        return specs

    def _runnable(self, specs: dict[str, HandlerSpec]) -> list[_Row]:
        """Rows a claim could take, ignoring time: in id order, the oldest of each key only."""
        keys: set[tuple[str, str]] = set()
        rows = []
        for row in sorted(self._outbox.values(), key=lambda r: r.id):
            if row.queue not in specs:
                continue
            if row.ordering_key is not None:
                key = (row.queue, row.ordering_key)
                if key in keys:
                    continue
                keys.add(key)
            rows.append(row)
        return rows

    def _due(self, specs: dict[str, HandlerSpec]) -> list[tuple[HandlerSpec, list[_Row]]]:
        """The next call per queue: one due row, or up to `batch` of them."""
        runnable = [r for r in self._runnable(specs) if r.due_at <= self.now]
        calls = []
        for queue, spec in specs.items():
            rows = [r for r in runnable if r.queue == queue]
            if rows:
                calls.append((spec, rows[: spec.batch or 1]))
        return calls

    async def _run(self, spec: HandlerSpec, rows: list[_Row], collector: Collector) -> None:
        runs: list[tuple[_Row, Message]] = []
        for row in rows:
            row.deliveries_count += 1
            msg = row.message(self.now)
            verdict = decision.before_run(spec, msg)
            if verdict is None:
                runs.append((row, msg))
            else:
                self._settle(row, msg, verdict, collector)
        if not runs:
            return
        messages = [msg for _, msg in runs]
        began = time.perf_counter()
        exc = await _call(spec, messages if spec.batch is not None else messages[0])
        duration = time.perf_counter() - began
        for row, msg in runs:
            outcome = self._settle(
                row, msg, decision.decide(spec, msg, exc, self.now, duration), collector
            )
            await on_failure(spec, msg, exc, outcome)

    def _settle(
        self, row: _Row, msg: Message, verdict: decision.Verdict, collector: Collector
    ) -> Outcome:
        """Apply a verdict to the memory outbox as the completer would to the table."""
        outcome, notes = verdict
        collector.decided(msg, outcome)
        if notes:
            collector.noted(msg, notes)
        if outcome.kind is Kind.RETRY:
            row.due_at = self.now + outcome.delay
            if outcome.ran:
                row.attempts_count += 1
                if row.first_attempt_at is None:
                    row.first_attempt_at = self.now
        else:
            del self._outbox[row.id]
            if outcome.kind is Kind.TERMINAL:
                self.dead_letters.append(msg)
        return outcome


async def _call(spec: HandlerSpec, arg: Any) -> BaseException | None:
    """The handler through the executor's own call path (`invoke`): None when it returned,
    else what it raised (past its timeout: `HandlerTimeout`)."""
    try:
        async with asyncio.timeout(spec.effective_timeout) as timer:
            await call_path(spec)(arg)
    except TimeoutError as error:
        return timed_out(spec) if timer.expired() else error
    except BaseException as error:
        return error
    return None


@contextmanager
def record(farm: Farm) -> Iterator[Recorder]:
    """`farm`'s publish calls recorded in memory for the block (see `Recorder`)."""
    recorder = Recorder(farm)
    saved = {name: farm.__dict__[name] for name in _CALLS}
    for name in _CALLS:
        setattr(farm, name, getattr(recorder, name))
    try:
        yield recorder
    finally:
        for name, call in saved.items():
            setattr(farm, name, call)
