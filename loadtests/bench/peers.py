"""The latency tail beside a peer's: commit -> handler start of the farm's runtime, of the raw
LISTEN + claim loop (`latency.raw_latency`, the floor) and of pgqueuer, a PostgreSQL job queue
for Python that also wakes its workers by LISTEN/NOTIFY, all fed by the same spawned producer
in alternating runs at each offered rate. `tail.py` says how close the farm comes to the floor;
this says whether a peer's tail is any shorter on the same producer, server and floor.

    pip install -e '.[peers]'
    python -m loadtests.bench.peers --dsn "host=127.0.0.1 user=postgres dbname=postgres" \\
        --rates 200,2000 --runs 5

The producer is `latency.latency_producer` for all three: one message per transaction at a
steady rate, `time.time()` noted right after each commit returns. For pgqueuer it enqueues
through pgqueuer's own synchronous `SyncQueries.enqueue` (its statement, its NOTIFY trigger),
on an autocommit connection, as pgqueuer requires, inside `conn.transaction()`: the same BEGIN,
one statement and COMMIT as the farm's publish. Each handler notes `time.time()` first thing.

pgqueuer runs as its docs advise for a worker: one `QueueManager` on one direct asyncpg
connection (its `AsyncpgDriver`, which both LISTENs and queries), batch size 10 ("1 x batch
10"), no concurrency caps, its schema installed by `Queries.install()` in the scratch
database with the autovacuum settings of its checklist (`pgq autovac`), default durability
(every table logged, as the farm's outbox). Its `SchedulerManager` is not started: there are
no schedules to run. The farm runs 64 executors, as in `tail.py`.

Not its psycopg driver: that one waits for NOTIFYs inside psycopg's `notifies()`, holding its
one connection up to a second at a time, so each of pgqueuer's queries waited for the next
notification (about 5 ms at 200 msg/s, a second for a run's last job). asyncpg delivers
notifications by callback, beside the queries.

pgqueuer leaves its dead rows to autovacuum (its docs tune it); the farm VACUUMs its own
outbox. So each pgqueuer run starts with its queue table VACUUMed, as autovacuum would keep
it, not behind the dead rows of every earlier run: on a server with autovacuum off (the report
prints the setting) those made each 2,000 msg/s run slower than the one before. Within a run
nothing is vacuumed for it, as autovacuum's minute-long naptime would not either.

Each run measures all three, the order rotated every run, so that a busy spell of the machine
falls on each as often. Per rate the report prints each run's p50 / p95 / p99 / max in ms;
then per contender the median over the runs of each of these, with the runs' range; then each
contender ÷ raw loop, the median over the runs of each run's ratio (the machine moves the
numbers of one run together far more than it moves their ratio). The last line says whether
the farm's p95 and p99 (medians over the runs) are at or below pgqueuer's at each rate.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from functools import partial
from importlib.metadata import version
from typing import Any

import orjson
import psycopg
import uvloop
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from loadtests.common import tables
from loadtests.common.harness import note
from outbox_farm import Farm

from .common import QUEUE, scratch, server, server_info, time_limit, turns_parser, write_json
from .latency import Latency, Publish, latency, measure, raw_latency
from .report import print_code, verdict
from .tail import CONCURRENCY

try:
    import asyncpg  # type: ignore[import-untyped]
    from pgqueuer import AsyncpgDriver, Job, PsycopgDriver, Queries, QueueManager
    from pgqueuer.db import SyncPsycopgDriver
    from pgqueuer.ports.driver import NotifyCallback
    from pgqueuer.queries import SyncQueries
except ImportError as missing:
    raise SystemExit(
        f"pgqueuer is not installed ({missing}): pip install -e '.[peers]'"
    ) from missing

PGQUEUER = version("pgqueuer")
BATCH = 10  # pgqueuer's batch size: its default, and the earlier comparison's "1 x batch 10"
CONTENDERS = ("farm", "raw", "pgqueuer")
LABELS = {"farm": "farm", "raw": "raw loop", "pgqueuer": "pgqueuer"}
CUTS = ("p50_ms", "p95_ms", "p99_ms", "max_ms")
TAIL = ("p95_ms", "p99_ms")  # the cuts the verdict compares


def pgqueuer_publisher(conn: psycopg.Connection[Any]) -> Publish:
    """pgqueuer's own enqueue for the spawned producer. Its driver refuses a connection outside
    autocommit; the producer's `conn.transaction()` then sends the same BEGIN and COMMIT around
    each enqueue as it does around the farm's publish on a connection that is not."""
    conn.autocommit = True
    queries = SyncQueries(SyncPsycopgDriver(conn))
    return lambda body: queries.enqueue(QUEUE, orjson.dumps(body))


class _ListeningDriver(AsyncpgDriver):
    """pgqueuer's asyncpg driver, saying when its LISTEN is in place: a run starts only once
    pgqueuer is listening, as `latency._farm` starts once the runtime's listener connected."""

    def __init__(self, connection: asyncpg.Connection) -> None:
        super().__init__(connection)
        self.listening = asyncio.Event()

    async def add_listener(self, channel: str, callback: NotifyCallback) -> None:
        await super().add_listener(channel, callback)
        self.listening.set()


@asynccontextmanager
async def _pgqueuer(dsn: str, note_start: Callable[[int, float], None]) -> AsyncIterator[None]:
    """A receiver for `latency.measure`, shaped as `latency._raw`: one pgqueuer QueueManager,
    batch `BATCH`, its entrypoint noting each job's message number first thing; its queue table
    VACUUMed first, as autovacuum, which pgqueuer leaves its dead rows to, would keep it."""
    conn = await _asyncpg_connect(dsn)
    try:
        driver = _ListeningDriver(conn)
        queries = Queries(driver)
        settings = queries.qbe.settings
        table = sql.Identifier(*filter(None, (settings.db_schema, settings.queue_table)))
        await conn.execute(sql.SQL("VACUUM {}").format(table).as_string(None))
        manager = QueueManager(queries)

        @manager.entrypoint(QUEUE)
        async def handle(job: Job) -> None:
            now = time.time()  # first thing: the handler started
            assert job.payload is not None
            note_start(orjson.loads(job.payload)["i"], now)

        running = asyncio.create_task(manager.run(batch_size=BATCH))
        listening = asyncio.create_task(driver.listening.wait())
        await asyncio.wait((running, listening), return_when=asyncio.FIRST_COMPLETED)
        listening.cancel()
        if running.done():
            await running  # raises what stopped it, if anything did
            raise RuntimeError("pgqueuer stopped before it listened")
        try:
            yield
        finally:
            manager.shutdown.set()
            await running
    finally:
        await conn.close()


async def _asyncpg_connect(dsn: str) -> asyncpg.Connection:
    """`dsn`, a libpq conninfo, as asyncpg takes it (keywords; `dbname` is its `database`)."""
    params: dict[str, Any] = conninfo_to_dict(dsn)
    params["database"] = params.pop("dbname", None)
    return await asyncpg.connect(**params)


async def pgqueuer_latency(dsn: str, n: int, rate: float, budget: float) -> Latency:
    """pgqueuer's latency, measured as `latency.raw_latency` measures the floor's."""
    return await measure(
        dsn, n, rate, 1, budget, partial(_pgqueuer, dsn), publisher=pgqueuer_publisher
    )


async def install(dsn: str) -> None:
    """pgqueuer's tables, trigger and autovacuum settings, in the scratch database only."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        queries = Queries(PsycopgDriver(conn))
        await queries.install()
        await queries.optimize_autovacuum()


@dataclass
class Run:
    """One run: each contender's latency, and the order they ran in."""

    order: tuple[str, ...]
    results: dict[str, Latency]

    def ratio(self, name: str, cut: str) -> float:
        """`name` ÷ the raw loop at `cut`, in this run."""
        raw = getattr(self.results["raw"], cut)
        return getattr(self.results[name], cut) / raw if raw else 0.0


async def run_rounds(dsn: str, rate: float, messages: int, runs: int, budget: float) -> list[Run]:
    contenders = {
        "farm": partial(latency, dsn, messages, rate, CONCURRENCY, budget),
        "raw": partial(raw_latency, dsn, messages, rate, budget),
        "pgqueuer": partial(pgqueuer_latency, dsn, messages, rate, budget),
    }
    found = []
    for run in range(runs):
        order = CONTENDERS[run % 3 :] + CONTENDERS[: run % 3]
        note(f"  {rate:g} msg/s, run {run + 1}/{runs} ({', '.join(order)})")
        results = {name: await contenders[name]() for name in order}
        late = [name for name, result in results.items() if not result.completed]
        if late:
            raise SystemExit(f"{', '.join(late)} at {rate:g} msg/s did not finish in {budget:g}s")
        found.append(Run(order, results))
    return found


def spread(runs: list[Run], name: str, cut: str) -> tuple[float, float, float]:
    """Median, least and greatest over the runs of one contender's `cut`."""
    values = [getattr(run.results[name], cut) for run in runs]
    return statistics.median(values), min(values), max(values)


def ratios(runs: list[Run], name: str) -> tuple[float, ...]:
    """Median over the runs of each run's `name` ÷ raw loop, per cut."""
    return tuple(statistics.median(run.ratio(name, cut) for run in runs) for cut in CUTS)


def at_or_below(runs: list[Run]) -> dict[str, bool]:
    """Whether the farm's median p95 and p99 are at or below pgqueuer's."""
    return {cut: spread(runs, "farm", cut)[0] <= spread(runs, "pgqueuer", cut)[0] for cut in TAIL}


def summary(rate: float, messages: int, runs: list[Run]) -> dict[str, Any]:
    return {
        "rate": rate,
        "messages": messages,
        "runs": [
            {"order": list(run.order), **{k: asdict(v) for k, v in run.results.items()}}
            for run in runs
        ],
        "median": {
            name: {
                cut: dict(zip(("median", "min", "max"), spread(runs, name, cut), strict=True))
                for cut in CUTS
            }
            for name in CONTENDERS
        },
        "over_raw": {
            name: dict(zip(CUTS, ratios(runs, name), strict=True)) for name in ("farm", "pgqueuer")
        },
        "farm_at_or_below_pgqueuer": at_or_below(runs),
    }


def print_rate(rate: float, runs: list[Run]) -> None:
    print(f"\ncommit -> handler start at {rate:g} msg/s, ms p50 / p95 / p99 / max")
    print(f"{'run':>4}  {'order':24}" + "".join(f"  {LABELS[n]:>27}" for n in CONTENDERS))
    for k, run in enumerate(runs, 1):
        cells = (
            " / ".join(f"{getattr(run.results[name], cut):.2f}" for cut in CUTS)
            for name in CONTENDERS
        )
        print(f"{k:>4}  {', '.join(run.order):24}" + "".join(f"  {c:>27}" for c in cells))
    print(f"\nmedian over {len(runs)} runs (range), ms")
    print(f"{'':10}" + "".join(f"  {cut[:-3]:>22}" for cut in CUTS))
    for name in CONTENDERS:
        cells = ("{:.2f} ({:.2f}-{:.2f})".format(*spread(runs, name, cut)) for cut in CUTS)
        print(f"{LABELS[name]:10}" + "".join(f"  {c:>22}" for c in cells))
    print("\n÷ raw loop, median over the runs of each run's ratio, p50 / p95 / p99 / max")
    for name in ("farm", "pgqueuer"):
        print(f"{LABELS[name]:10}  " + " / ".join(f"{r:.2f}" for r in ratios(runs, name)))


def print_verdict(by_rate: dict[float, list[Run]]) -> None:
    parts = []
    for rate, runs in by_rate.items():
        ok = at_or_below(runs)
        cuts = ", ".join(
            f"{cut[:-3]} {verdict(ok[cut])} ({spread(runs, 'farm', cut)[0]:.2f} vs "
            f"{spread(runs, 'pgqueuer', cut)[0]:.2f} ms)"
            for cut in TAIL
        )
        parts.append(f"{rate:g} msg/s: {cuts}")
    print(f"\nfarm's p95 and p99 at or below pgqueuer's: {'; '.join(parts)}")


def main(argv: list[str] | None = None) -> int:
    parser = turns_parser("python -m loadtests.bench.peers", __doc__)
    args = parser.parse_args(argv)
    rates: list[float] = args.rates
    by_rate: dict[float, list[Run]] = {}
    results: dict[str, Any] = {"pgqueuer": PGQUEUER, "batch": BATCH}
    with (
        time_limit(120 + len(rates) * len(CONTENDERS) * args.runs * (args.seconds + 15)),
        server(args.dsn) as admin,
        scratch(admin, Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)) as dsn,
    ):
        uvloop.run(install(dsn))
        info = server_info(dsn)
        results["server"] = info
        if not args.json:
            print_code(info)
            print(
                f"pgqueuer {PGQUEUER}: one QueueManager, asyncpg driver, batch {BATCH}, its "
                f"table VACUUMed before each run; farm: {CONCURRENCY} executors; "
                f"{len(rates)} rates x {args.runs} runs; server autovacuum {info['autovacuum']}"
            )
        for rate in rates:
            messages = max(1_000, int(rate * args.seconds))
            budget = messages / rate + 60
            runs = uvloop.run(run_rounds(dsn, rate, messages, args.runs, budget))
            by_rate[rate] = runs
            results[f"{rate:g}"] = summary(rate, messages, runs)
            if not args.json:
                print_rate(rate, runs)
    if args.json:
        write_json("-", results)
    else:
        print_verdict(by_rate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
