"""The publish workloads and their phases, shared by the producer benchmark
(`producer.py`) and the standard report: the same loop as outbox_farm and as raw SQL, one
message per transaction from one or many processes, and publish_batch.

Each phase starts from an emptied table and reports what it did by its time budget.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
import uuid
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import orjson
import psycopg
from psycopg import sql

from outbox_farm import Farm

from .common import QUEUE, percentiles, raise_errors, reap

WARMUP_QUEUE = "warmup"
TARGET_ONE_PER_TXN = 2_000.0  # msg/s, one message per transaction
TARGET_BATCH = 50_000.0  # rows/s, publish_batch of 100
TARGET_OF_BATCH_FLOOR = 2 / 3  # publish_batch against raw psycopg sending the same rows


# -- the table between phases ----------------------------------------------------------------


def reset_table(dsn: str, farm: Farm) -> None:
    """Empty the outbox and checkpoint, so every phase starts from the same state."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("TRUNCATE {} RESTART IDENTITY").format(farm.names.outbox.identifier()))
        with suppress(psycopg.Error):  # not a superuser: phases share checkpoint timing
            conn.execute("CHECKPOINT")


def count_rows(dsn: str, farm: Farm, queue: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        query = sql.SQL("SELECT count(*) FROM {} WHERE queue = %s").format(
            farm.names.outbox.identifier()
        )
        return int(conn.execute(query, [queue]).fetchone()[0])


# -- the publish loops (module level: spawned producer processes import them) ---------------


def body(i: int) -> dict[str, Any]:
    return {"i": i, "kind": "bench", "note": "outbox_farm producer benchmark"}


def raw_queries(farm: Farm) -> dict[str, sql.Composed]:
    table = farm.names.outbox.identifier()
    insert = sql.SQL(
        "INSERT INTO {} (queue, payload, headers) VALUES (%s, %s, %s::jsonb) RETURNING id"
    ).format(table)
    one = sql.SQL(
        "WITH ins AS (INSERT INTO {} (queue, payload, headers) VALUES (%s, %s, %s::jsonb) "
        "RETURNING id) SELECT ins.id, pg_notify(%s, %s) FROM ins"
    ).format(table)
    return {"insert": insert, "one": one}


def make_step(mode: str, conn: psycopg.Connection[Any], farm: Farm) -> Callable[[int], None]:
    """One message in one transaction, the `mode` way; returns the callable for message i."""
    channel = farm.names.channel
    raw = raw_queries(farm)

    def headers() -> str:
        return orjson.dumps(
            {"content-type": "application/json", "correlation_id": uuid.uuid4().hex}
        ).decode()

    def publish(i: int) -> None:
        with conn.transaction():
            farm.publish(conn, body(i), queue=QUEUE)

    def raw_one(i: int) -> None:
        with conn.transaction():
            conn.execute(raw["one"], [QUEUE, orjson.dumps(body(i)), headers(), channel, QUEUE])

    def raw_two(i: int) -> None:
        with conn.transaction():
            conn.execute(raw["insert"], [QUEUE, orjson.dumps(body(i)), headers()]).fetchone()
            conn.execute("SELECT pg_notify(%s, %s)", [channel, QUEUE])

    return {"publish": publish, "raw_one": raw_one, "raw_two": raw_two}[mode]


def warm_up(conn: psycopg.Connection[Any], farm: Farm, n: int = 100) -> None:
    """Connect-time costs and psycopg's statement preparation out of the measured loop."""
    for i in range(n):
        with conn.transaction():
            farm.publish(conn, body(-i), queue=WARMUP_QUEUE)


def timed_loop(
    step: Callable[[int], None], start: int, count: int, deadline: float
) -> tuple[int, float, float, list[float]]:
    """Run `step` for ids start.. start+count; (done, t_start, t_end, per-call seconds)."""
    durations: list[float] = []
    t_start = time.perf_counter()
    clock = time.perf_counter
    done = 0
    for i in range(start, start + count):
        began = clock()
        step(i)
        ended = clock()
        durations.append(ended - began)
        done += 1
        if ended > deadline:
            break
    return done, t_start, clock(), durations


def producer_process(
    dsn: str, mode: str, start: int, count: int, barrier: Any, results: Any, budget: float
) -> None:
    """A spawned producer: connect and warm up, meet the others at the barrier, publish."""
    farm = Farm()
    try:
        with psycopg.connect(dsn) as conn:
            warm_up(conn, farm, 50)
            step = make_step(mode, conn, farm)
            barrier.wait(timeout=60)
            # time.perf_counter() is CLOCK_MONOTONIC on Linux: comparable across processes.
            done, t0, t1, durations = timed_loop(step, start, count, time.perf_counter() + budget)
        results.put({"done": done, "t0": t0, "t1": t1, "durations": durations})
    except Exception as exc:
        results.put({"error": repr(exc)})


# -- phases ---------------------------------------------------------------------------------


@dataclass
class Phase:
    name: str
    label: str
    messages: int
    seconds: float
    rate: float
    unit: str = "msg/s"
    target: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    verified: bool = True
    truncated: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def measured(
        cls,
        dsn: str,
        farm: Farm,
        asked: int,
        done: int,
        seconds: float,
        durations: list[float],
        **fields: Any,
    ) -> Phase:
        """The phase's figures, `verified` only when the table holds exactly the rows it
        reported: a publish that silently did nothing must not count as fast."""
        cuts = percentiles(durations, 50, 99)
        p50, p99 = (None, None) if cuts is None else (cuts[0] * 1000, cuts[1] * 1000)
        return cls(
            messages=done,
            seconds=seconds,
            rate=done / seconds,
            p50_ms=p50,
            p99_ms=p99,
            verified=count_rows(dsn, farm, QUEUE) == done,
            truncated=done < asked,
            **fields,
        )

    @property
    def meets_target(self) -> bool | None:
        return None if self.target is None else self.rate >= self.target


def single_phase(
    dsn: str,
    farm: Farm,
    mode: str,
    n: int,
    budget: float,
    name: str,
    label: str,
    target: float | None,
) -> Phase:
    reset_table(dsn, farm)
    with psycopg.connect(dsn) as conn:
        warm_up(conn, farm)
        step = make_step(mode, conn, farm)
        done, t0, t1, durations = timed_loop(step, 0, n, time.perf_counter() + budget)
    return Phase.measured(
        dsn, farm, n, done, t1 - t0, durations, name=name, label=label, target=target
    )


def concurrent_phase(
    dsn: str, farm: Farm, n: int, producers: int, budget: float, name: str, label: str
) -> Phase:
    reset_table(dsn, farm)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(producers + 1)
    results = ctx.Queue()
    share, extra = divmod(n, producers)
    procs, start = [], 0
    for k in range(producers):
        count = share + (1 if k < extra else 0)
        proc = ctx.Process(
            target=producer_process,
            args=(dsn, "publish", start, count, barrier, results, budget),
            name=f"bench-producer-{k}",
            daemon=True,
        )
        proc.start()
        procs.append(proc)
        start += count
    reports: list[dict[str, Any]] = []
    try:
        barrier.wait(timeout=60)
        for _ in procs:
            reports.append(results.get(timeout=budget + 60))
    finally:
        reap(procs)
    raise_errors(reports, "producer processes")
    done = sum(r["done"] for r in reports)
    seconds = max(r["t1"] for r in reports) - min(r["t0"] for r in reports)
    per_process = [r["done"] / (r["t1"] - r["t0"]) for r in reports]
    return Phase.measured(
        dsn,
        farm,
        n,
        done,
        seconds,
        [d for r in reports for d in r["durations"]],
        name=name,
        label=label,
        target=TARGET_ONE_PER_TXN,
        extra={"producers": producers, "per_process_msg_s": [round(r, 1) for r in per_process]},
    )


RAW_BATCH_MODES = {"raw_unnest": "INSERT over arrays", "raw_copy": "COPY"}
"""The raw batch floor's two ways (`BATCH_MODES` keys), with what a report calls them."""

BATCH_MODES = {
    "publish_batch": ("c_publish_batch", "(c) publish_batch, {size}/txn", TARGET_BATCH),
    "raw_unnest": ("raw_batch_unnest", "baseline: raw INSERT over arrays, {size}/txn", None),
    "raw_copy": ("raw_batch_copy", "baseline: raw COPY + pg_notify, {size}/txn", None),
}
"""The batch phases: publish_batch, and the floor it is held against, raw psycopg sending the
same bytes per row (the JSON body; headers with content type and a fresh correlation id) in the
two cheapest ways we know: one INSERT over binary arrays returning the ids (publish_batch's
own statement shape, without the farm's code around it), and COPY (no ids back)."""


def make_batch_step(
    mode: str, conn: psycopg.Connection[Any], farm: Farm
) -> Callable[[list[dict[str, Any]]], None]:
    """Send one batch of bodies in one transaction, the `mode` way."""
    table = farm.names.outbox.identifier()
    channel = farm.names.channel
    unnest = sql.SQL(
        "INSERT INTO {} (queue, payload, headers) SELECT %s, b.payload, b.headers "
        "FROM unnest(%b::bytea[], %b::jsonb[]) WITH ORDINALITY AS b(payload, headers, n) "
        "ORDER BY b.n RETURNING id"
    ).format(table)
    copy = sql.SQL("COPY {} (queue, payload, headers) FROM STDIN").format(table)

    def encoded(bodies: list[dict[str, Any]]) -> tuple[list[bytes], list[str]]:
        payloads = [orjson.dumps(b) for b in bodies]
        headers = [
            orjson.dumps(
                {"content-type": "application/json", "correlation_id": os.urandom(16).hex()}
            ).decode()
            for _ in bodies
        ]
        return payloads, headers

    def publish_batch(bodies: list[dict[str, Any]]) -> None:
        with conn.transaction():
            farm.publish_batch(conn, bodies, queue=QUEUE)

    def raw_unnest(bodies: list[dict[str, Any]]) -> None:
        payloads, headers = encoded(bodies)
        with conn.transaction():
            conn.execute(unnest, [QUEUE, payloads, headers]).fetchall()
            conn.execute("SELECT pg_notify(%s, %s)", [channel, QUEUE])

    def raw_copy(bodies: list[dict[str, Any]]) -> None:
        payloads, headers = encoded(bodies)
        with conn.transaction():
            with conn.cursor().copy(copy) as rows:
                for payload, header in zip(payloads, headers, strict=True):
                    rows.write_row((QUEUE, payload, header))
            conn.execute("SELECT pg_notify(%s, %s)", [channel, QUEUE])

    return {"publish_batch": publish_batch, "raw_unnest": raw_unnest, "raw_copy": raw_copy}[mode]


def batch_phase(
    dsn: str, farm: Farm, n: int, size: int, budget: float, mode: str = "publish_batch"
) -> Phase:
    """`n` rows in batches of `size`, one batch per transaction, the `mode` way (`BATCH_MODES`)."""
    name, label, target = BATCH_MODES[mode]
    reset_table(dsn, farm)
    durations: list[float] = []
    done = 0
    with psycopg.connect(dsn) as conn:
        step = make_batch_step(mode, conn, farm)
        for _ in range(5):  # warm-up
            with conn.transaction():
                farm.publish_batch(conn, [body(-j) for j in range(size)], queue=WARMUP_QUEUE)
            step([body(-j) for j in range(size)])
        reset_table(dsn, farm)
        deadline = time.perf_counter() + budget
        t0 = time.perf_counter()
        while done < n and time.perf_counter() < deadline:
            bodies = [body(done + j) for j in range(min(size, n - done))]
            began = time.perf_counter()
            step(bodies)
            durations.append(time.perf_counter() - began)
            done += len(bodies)
        seconds = time.perf_counter() - t0
    return Phase.measured(
        dsn,
        farm,
        n,
        done,
        seconds,
        durations,
        name=name,
        label=label.format(size=size),
        unit="rows/s",
        target=target,
        extra={"batch_size": size, "batches_per_s": round(len(durations) / seconds, 1)},
    )


def batch_floor(phases: list[Phase]) -> Phase | None:
    """The faster of the raw batch baselines among `phases`, if any ran."""
    names = {BATCH_MODES[mode][0] for mode in RAW_BATCH_MODES}
    raws = [p for p in phases if p.name in names]
    return max(raws, key=lambda p: p.rate) if raws else None


def median_phase(runs: list[Phase]) -> Phase:
    """The round with the median rate (the lower one for an even count), all rates noted."""
    middle = statistics.median_low(p.rate for p in runs)
    chosen = next(p for p in runs if p.rate == middle)
    if len(runs) > 1:
        chosen.extra["rates_by_round"] = [round(p.rate, 1) for p in runs]
    chosen.verified = all(p.verified for p in runs)
    return chosen
