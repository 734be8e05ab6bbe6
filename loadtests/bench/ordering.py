"""Per-key ordering benchmark: what `ordering_key` costs a `--procs 2` drain, and proof that one
key runs strictly one row at a time.

    python -m loadtests.bench.ordering --dsn "host=127.0.0.1 user=postgres dbname=postgres"

In one run, on one scratch database: the same --rows no-op rows (published by `publish_batch`,
headers and all) drained by `outbox-farm start --procs 2` without keys, then spread over --keys
ordering keys, --pairs times in turn (target: the median of the pairs' keyed/unkeyed ratios
>= 0.8); then --one-key-rows rows of a single key (target: >= 500 msg/s), each run recorded in a
ledger and checked: strictly in publish order, never two at once.

A drain of 50,000 rows lasts about a second, and on a shared two-core machine one such drain
moves by 15% from the next: a ratio of two of them, by more. Each pair runs its two drains
back to back, so both see the same machine, and the median of the pairs is the figure; every
pair is printed, with the machine's CPU time per message of each drain beside it (what a
before/after comparison should read, see `farm.drain_run`).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psycopg

from loadtests.common import tables
from loadtests.common.harness import note
from outbox_farm import Farm

from .common import add_dsn, scratch, server
from .farm import APP, drain_run
from .report import print_measures, verdict

TARGET_RATIO = 0.8  # keyed over unkeyed drain
ONE_KEY_TARGET = 500  # msg/s of one key, strictly one row at a time across both processes

LEDGER_APP = """
import os, time
import psycopg
from outbox_farm import Farm
from loadtests.common.tables import DLQ, OUTBOX
farm = Farm(table=OUTBOX, dlq_table=DLQ)
_conn = []

@farm.handler("bench", concurrency=64)
async def handle(msg):
    if not _conn:
        dsn = os.environ["BENCH_DSN"]
        _conn.append(await psycopg.AsyncConnection.connect(dsn, autocommit=True))
        if os.environ.get("BENCH_LEDGER_FLUSH") != "1":
            # The ledger is this benchmark's evidence, not the farm's work: without this its
            # every row waits for its own WAL flush, a second commit per message timed as the
            # handler's (--ledger-flush measures with it).
            await _conn[0].execute("SET synchronous_commit = off")
    began = time.time()
    await _conn[0].execute(
        "INSERT INTO ledger VALUES (%s, %s, %s)", (msg.id, began, time.time())
    )
"""


def one_key(
    dsn: str, rows: int, appdir: Path, *, ledger_flush: bool = False
) -> tuple[float, str | None]:
    """The single-key drain's rate, and what was wrong with its ledger (None: nothing).
    `ledger_flush`: each ledger row waits for its WAL flush (synchronous_commit on)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS ledger")
        conn.execute("CREATE TABLE ledger (id bigint, began float8, ended float8)")
    (appdir / "ledgerapp.py").write_text(LEDGER_APP)
    env = {"BENCH_DSN": dsn, "BENCH_LEDGER_FLUSH": "1" if ledger_flush else "0"}
    result = drain_run(dsn, 2, rows, appdir, keys=1, app="ledgerapp:farm", env=env)
    with psycopg.connect(dsn, autocommit=True) as conn:
        runs = conn.execute("SELECT id, began, ended FROM ledger ORDER BY began").fetchall()
    ids = [run[0] for run in runs]
    if ids != sorted(ids) or len(set(ids)) != len(ids):
        return result["rate"], "rows did not run once each in publish order"
    for before, after in itertools.pairwise(runs):
        if after[1] < before[2]:
            return result["rate"], f"row {after[0]} began while row {before[0]} ran"
    return result["rate"], None


@dataclass(frozen=True)
class Pair:
    """An unkeyed drain and the keyed drain right after it (`drain_run`'s results)."""

    plain: dict[str, float]
    keyed: dict[str, float]

    @property
    def ratio(self) -> float:
        return self.keyed["rate"] / self.plain["rate"]

    def line(self) -> str:
        plain, keyed = self.plain, self.keyed
        return (
            f"  {plain['rate']:>9,.0f} {keyed['rate']:>9,.0f} {self.ratio:>7.2f}"
            f" {plain['machine_cpu_us_per_message']:>11.1f}"
            f" {keyed['machine_cpu_us_per_message']:>11.1f}"
        )


def pairs(dsn: str, rows: int, keys: int, appdir: Path, count: int) -> list[Pair]:
    """`count` pairs of drains of `rows` rows, each the unkeyed drain, then the keyed one."""
    done: list[Pair] = []
    for n in range(1, count + 1):
        note(f"pair {n} of {count}: draining {rows:,} rows without keys, --procs 2 ...")
        # Published as the keyed rows are, headers and all: the ratio is the cost of the keys.
        plain = drain_run(dsn, 2, rows, appdir, published=True)
        note(f"pair {n} of {count}: draining {rows:,} rows over {keys:,} keys, --procs 2 ...")
        keyed = drain_run(dsn, 2, rows, appdir, keys=keys)
        done.append(Pair(plain, keyed))
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.ordering", description=__doc__.split("\n\n")[0]
    )
    add_dsn(parser)
    parser.add_argument("--rows", type=int, default=50_000, help="rows in each drain of a pair")
    parser.add_argument(
        "--keys", type=int, default=10_000, help="ordering keys the keyed drain's rows spread over"
    )
    parser.add_argument(
        "--pairs",
        type=int,
        default=3,
        help="unkeyed and keyed drains run in turn this many times; the median ratio counts",
    )
    parser.add_argument(
        "--one-key-rows",
        type=int,
        default=2_000,
        help="rows of the single hot key, checked in order and one at a time",
    )
    parser.add_argument(
        "--ledger-flush",
        action="store_true",
        help="commit each ledger row with synchronous_commit on, as the handler's own write",
    )
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    with (
        server(args.dsn) as admin,
        scratch(admin, Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)) as dsn,
        tempfile.TemporaryDirectory() as folder,
    ):
        appdir = Path(folder)
        (appdir / "benchapp.py").write_text(APP)
        drains = pairs(dsn, args.rows, args.keys, appdir, args.pairs)
        note(f"draining {args.one_key_rows:,} rows of one key, --procs 2, with a ledger ...")
        single, problem = one_key(dsn, args.one_key_rows, appdir, ledger_flush=args.ledger_flush)
    ratio = statistics.median(pair.ratio for pair in drains)
    print()
    print(f"pairs, {args.rows:,} rows each, --procs 2 (machine CPU: µs per message)")
    print(f"  {'unkeyed':>9} {'keyed':>9} {'ratio':>7} {'CPU unkeyed':>11} {'CPU keyed':>11}")
    for pair in drains:
        print(pair.line())
    print()
    print_measures(
        [
            (
                f"drain, {args.rows:,} rows, no keys (msg/s, median)",
                f"{statistics.median(p.plain['rate'] for p in drains):,.0f}",
                "-",
                verdict(None),
            ),
            (
                f"drain, {args.rows:,} rows over {args.keys:,} keys (msg/s, median)",
                f"{statistics.median(p.keyed['rate'] for p in drains):,.0f}",
                "-",
                verdict(None),
            ),
            (
                f"  keyed / unkeyed (median of {len(drains)})",
                f"{ratio:.2f}",
                f">= {TARGET_RATIO}",
                verdict(ratio >= TARGET_RATIO),
            ),
            (
                f"drain, {args.one_key_rows:,} rows of one key (msg/s)",
                f"{single:,.0f}",
                f">= {ONE_KEY_TARGET}",
                verdict(single >= ONE_KEY_TARGET),
            ),
            ("  one key: in order, one at a time", problem or "yes", "yes", verdict(not problem)),
        ],
        widths=(56, 12, 8),
    )
    met = ratio >= TARGET_RATIO and single >= ONE_KEY_TARGET
    return 0 if met and problem is None else 1


if __name__ == "__main__":
    sys.exit(main())
