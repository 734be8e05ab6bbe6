"""Commit -> handler-start latency of an idle runtime, shared by the runtime benchmark
(`runtime.py`) and the standard report, and the floor it stands beside: a raw LISTEN + claim
loop receiving the same messages from the same producer (`raw_latency`).

The runtime runs in this process (`farm.running`) and starts idle; a spawned producer process
publishes one message per transaction at a steady rate and notes `time.time()` right after
each commit returns; the handler notes it first thing. The producer is a process of its own
so that its GIL and the runtime's never share a core's time slices.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing as mp
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import orjson
import psycopg
from psycopg import sql

from loadtests.common.harness import note as note_stop
from outbox_farm import Farm, Message
from outbox_farm.prefork.heap import freeze_boot_heap

from . import floor
from .common import QUEUE, percentiles, raise_errors, reap

Publish = Callable[[dict[str, int]], object]
"""Publishes one message's body in the producer's open transaction."""

Publisher = Callable[[psycopg.Connection[Any]], Publish]
"""Given the producer's connection before its first transaction, how it publishes. It travels
to the spawned producer, so it must be a module-level function."""


def farm_publisher(conn: psycopg.Connection[Any]) -> Publish:
    """The farm's own `publish`: what every latency here measures unless told otherwise."""
    return partial(Farm().publish, conn, queue=QUEUE)


def latency_producer(
    dsn: str,
    n: int,
    warmup: int,
    rate: float,
    ready: Any,
    go: Any,
    results: Any,
    publisher: Publisher = farm_publisher,
) -> None:
    """Spawned: publish `warmup` then `n` messages, one per transaction, at `rate` per second.

    Sends back {id: time.time() right after the commit returned}. `publisher` lets a peer's
    enqueue ride the very same pacing, transaction and clock as the farm's publish.
    """
    commits: dict[int, float] = {}
    try:
        with psycopg.connect(dsn) as conn:
            publish = publisher(conn)
            ready.set()
            if not go.wait(timeout=60):
                raise TimeoutError("never told to start")
            interval = 1.0 / rate
            start = time.perf_counter()
            for k in range(warmup + n):
                wait = start + k * interval - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                i = k - warmup  # warm-up messages have negative ids
                with conn.transaction():
                    publish({"i": i})
                commits[i] = time.time()
        results.put({"commits": commits})
    except Exception as exc:
        results.put({"error": repr(exc)})


@dataclass
class Latency:
    messages: int
    rate: float
    concurrency: int
    received: int = 0
    p50_ms: float = 0.0
    p95_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    mean_ms: float = 0.0
    negative: int = 0  # handler started before the producer saw its commit return
    completed: bool = False


Receiver = Callable[[Callable[[int, float], None]], AbstractAsyncContextManager[None]]
"""Given `note(i, when)`, a context that delivers messages while it is open, calling `note` with
each message's number and the moment its handling began; entered: ready to receive."""


async def latency(dsn: str, n: int, rate: float, concurrency: int, budget: float) -> Latency:
    """The farm's latency: its runtime in this process, `concurrency` executors."""
    return await measure(dsn, n, rate, concurrency, budget, partial(_farm, dsn, concurrency))


async def raw_latency(dsn: str, n: int, rate: float, budget: float) -> Latency:
    """The floor beside it: the least code that delivers the same messages (see `_raw`)."""
    return await measure(dsn, n, rate, 1, budget, partial(_raw, dsn))


@asynccontextmanager
async def _farm(
    dsn: str, concurrency: int, note: Callable[[int, float], None]
) -> AsyncIterator[None]:
    farm = Farm()

    @farm.handler(QUEUE, concurrency=concurrency)
    async def handle(msg: Message) -> None:
        now = time.time()  # first thing: the handler started
        note(orjson.loads(msg.body)["i"], now)

    async with farm.running(dsn) as runtime, frozen_boot():
        assert runtime.listener is not None
        await runtime.listener.connected.wait()
        yield


@asynccontextmanager
async def frozen_boot() -> AsyncIterator[None]:
    """The heap as an `outbox-farm start` worker has it while it serves: what its boot left,
    frozen out of the collector's sight (`prefork.heap`); thawed after, for the next run."""
    freeze_boot_heap()
    try:
        yield
    finally:
        gc.unfreeze()


@asynccontextmanager
async def _raw(dsn: str, note: Callable[[int, float], None]) -> AsyncIterator[None]:
    """One connection LISTENs; on each notification another claims due rows with the drain
    floor's statement (`floor.CLAIM`) until a claim comes back short, notes every row as handled
    the moment its claim returned, and deletes them under their token: no executors, leases kept
    alive, metrics or outcome batching."""
    names = Farm().names
    claim, delete = floor.statements()
    connect = partial(psycopg.AsyncConnection.connect, dsn, autocommit=True)
    async with await connect() as listen, await connect() as work:
        await listen.execute(sql.SQL("LISTEN {}").format(sql.Identifier(names.channel)))

        async def deliver() -> None:
            async for _ in listen.notifies():
                while True:
                    token = uuid.uuid4()
                    params = {"queue": QUEUE, "limit": floor.BATCH, "token": token}
                    rows = await (await work.execute(claim, params)).fetchall()
                    now = time.time()
                    for row in rows:
                        note(orjson.loads(row[1])["i"], now)
                    if rows:
                        await work.execute(
                            delete, {"ids": [row[0] for row in rows], "token": token}
                        )
                    if len(rows) < floor.BATCH:
                        break

        task = asyncio.create_task(deliver())
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def measure(
    dsn: str,
    n: int,
    rate: float,
    concurrency: int,
    budget: float,
    receiver: Receiver,
    *,
    commits: dict[int, float] | None = None,
    publisher: Publisher = farm_publisher,
) -> Latency:
    """`n` messages at `rate` from a spawned producer to `receiver`, their latencies cut;
    `commits`, if given, gets each message's commit time (for a caller that splits them up);
    `publisher`, how the producer publishes (a peer's receiver needs its own enqueue)."""
    result = Latency(n, rate, concurrency)
    warmup = 50
    starts: dict[int, float] = {}
    all_in = asyncio.Event()

    def note(i: int, when: float) -> None:
        starts[i] = when
        if len(starts) >= n + warmup:
            all_in.set()

    ctx = mp.get_context("spawn")
    ready, go, results = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(
        target=latency_producer,
        args=(dsn, n, warmup, rate, ready, go, results, publisher),
        name="bench-latency-producer",
        daemon=True,
    )
    proc.start()  # spawning takes a while: overlap it with the receiver's start
    loop = asyncio.get_running_loop()
    report: dict[str, Any] = {}
    try:
        async with receiver(note), asyncio.timeout(budget):
            await loop.run_in_executor(None, ready.wait, 60)
            await asyncio.sleep(0.5)  # idle: the fetcher went back to sleep after its claims
            go.set()
            await all_in.wait()
            result.completed = True
            report = await loop.run_in_executor(None, results.get, True, 30)
    except TimeoutError:
        note_stop(f"latency: not finished after {budget:g}s; stopping")
    finally:
        go.set()
        await loop.run_in_executor(None, reap, [proc])
    raise_errors([report], "latency producer")
    committed: dict[int, float] = report.get("commits", {})
    if commits is not None:
        commits.update(committed)
    lags = [(starts[i] - committed[i]) * 1000 for i in range(n) if i in starts and i in committed]
    result.received = len(lags)
    cuts = percentiles(lags, 50, 95, 99)
    if cuts is not None:
        result.p50_ms, result.p95_ms, result.p99_ms = cuts
        result.max_ms, result.mean_ms = max(lags), statistics.fmean(lags)
        result.negative = sum(1 for lag in lags if lag < 0)
    return result
