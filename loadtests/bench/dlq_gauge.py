"""What the housekeeper's DLQ gauge costs on a large DLQ: 2 million rows by default.

A scratch database (created here, dropped at the end) gets --dlq-rows DLQ rows over --queues
queues. Then one gauge refresh (what the housekeeper runs every 5 s) is timed --runs times in
three ways: counting every time (no history: how every refresh went before the watch), with
the DLQ untouched since the last count (the statistics are read, the count is skipped), and
with one row added to the DLQ before each refresh (counted again, as soon as the pause after
the last count allows; the pause is off here so each refresh counts).

    python -m loadtests.bench.dlq_gauge --dsn "host=127.0.0.1 user=postgres dbname=postgres"
    python -m loadtests.bench.dlq_gauge --dlq-rows 200000

Without --dsn (and without OUTBOX_FARM_DSN) the embedded Postgres is started.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable

import psycopg
from psycopg_pool import AsyncConnectionPool

from loadtests.common import tables
from outbox_farm import Farm
from outbox_farm.chores import gauges
from outbox_farm.problems import Problems

from .common import add_dsn, scratch, server
from .stats import LOAD_DLQ

ONE_MORE = tables.query(
    "INSERT INTO {dlq} (original_id, queue, payload, deliveries_count, created_at, "
    "failed_at, failure_reason) VALUES (0, 'queue_0', 'x', 1, now(), now(), 'rejected')"
)


async def timed(
    runs: int, before: Callable[[], None], refresh: Callable[[], Awaitable[None]]
) -> str:
    """Median and max of `runs` refreshes, in ms, each after `before()`."""
    took = []
    for _ in range(runs):
        before()
        began = time.perf_counter()
        await refresh()
        took.append((time.perf_counter() - began) * 1000)
    return f"median {statistics.median(took):8.2f} ms, max {max(took):8.2f} ms"


async def measure(dsn: str, farm: Farm, queues: list[str], runs: int) -> dict[str, str]:
    problems = Problems()
    watch = gauges.DlqWatch(pause=0)
    results: dict[str, str] = {}
    with psycopg.connect(dsn, autocommit=True) as writer:

        def add_one() -> None:
            writer.execute(ONE_MORE)
            if writer.info.server_version >= 150000:  # else the statistics follow in ~0.5 s
                writer.execute("SELECT pg_stat_force_next_flush()")

        async with AsyncConnectionPool(dsn, kwargs={"autocommit": True}, open=False) as pool:

            async def with_watch() -> None:
                await gauges.refresh(pool, farm.queries, queues, problems, dlq=watch)

            async def counting() -> None:
                await gauges.refresh(pool, farm.queries, queues, problems)

            await with_watch()  # the first count, with the statistics settled
            counted = watch.counts
            results["count every refresh"] = await timed(runs, lambda: None, counting)
            results["untouched DLQ"] = await timed(runs, lambda: None, with_watch)
            skipped = watch.counts == counted
            results["a row added before each"] = await timed(runs, add_one, with_watch)
            recounted = watch.counts - counted
    assert problems.current is None, problems.current
    assert skipped, "the untouched DLQ was counted again"
    print(f"  counts with a row added before each refresh: {recounted} of {runs}")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.dlq_gauge", description=__doc__.split("\n")[0]
    )
    add_dsn(parser)
    parser.add_argument("--dlq-rows", type=int, default=2_000_000)
    parser.add_argument("--queues", type=int, default=4)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args(argv)
    farm = Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)
    queues = [f"queue_{n}" for n in range(args.queues)]
    with server(args.dsn) as admin, scratch(admin, farm) as dsn:
        print(f"loading {args.dlq_rows:,} DLQ rows over {args.queues} queues", flush=True)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(LOAD_DLQ, {"queues": args.queues, "rows": args.dlq_rows})
            conn.execute(tables.query("VACUUM ANALYZE {dlq}"))
        for label, result in asyncio.run(measure(dsn, farm, queues, args.runs)).items():
            print(f"  {label:<26} {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
