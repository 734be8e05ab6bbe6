"""Instructions per message: the farm's own CPU cost, counted by callgrind, gated against a
baseline committed beside this file.

Wall-clock throughput on a shared two-core machine moves by 10% from one run to the next; the
number of instructions the Python process executes for the same work does not. Each measure
runs its workload twice under `valgrind --tool=callgrind`, with a small and a large count, in
a child process of its own; the difference of the two totals divided by the difference of the
counts is the cost of one more unit, with the interpreter's start, the imports and the
connection set-up cancelled out. The database server is another process and is not counted.

  drain          the in-process runtime (`farm.running`, uvloop, the multiprocess metrics
                 registry as under `outbox-farm start`) handling pre-loaded rows with a no-op
                 async handler: claim, executor, verdict, observers, batched DELETE
  relay          the same runtime relaying pre-loaded rows in batches of the relay's default
                 size to a target that confirms every envelope at once (no broker): the relay's
                 batch path, envelopes and settling, per message
  publish_batch  `publish_batch` of 100 bodies per call, per row
  publish        `publish` of one body, per call (each in its own transaction)

    python -m loadtests.bench.instructions --dsn "host=127.0.0.1 user=postgres dbname=postgres"
    python -m loadtests.bench.instructions --dsn ... --update   # write a new baseline

Exit status 1 when a measure costs more than --tolerance (5%) over its baseline: a change
that makes the farm cheaper updates the baseline in the same commit (--update).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from loadtests.common.harness import note

from .common import QUEUE, add_dsn, scratch, server, time_limit

BASELINE = Path(__file__).with_name("instructions_baseline.json")
TOLERANCE = 0.05
BATCH = 100
CONCURRENCY = 256  # the drain's executors, as in the standard report's drains (`farm.APP`)
COLLECTED = re.compile(rb"Collected : (\d+)")


@dataclass(frozen=True)
class Measure:
    name: str
    unit: str
    small: int
    large: int
    preload: bool  # the rows are written before the child starts (by this process)


MEASURES = (
    Measure("drain", "message", 1_000, 5_000, preload=True),
    Measure("relay", "message", 4_000, 12_000, preload=True),
    Measure("publish_batch", "row", 1_000, 5_000, preload=False),
    Measure("publish", "call", 200, 1_000, preload=False),
)


# -- the workloads, run in the child under callgrind -------------------------------------------


def _drain(dsn: str, rows: int) -> None:
    import uvloop

    from outbox_farm import Farm, Message

    farm = Farm()
    handled = 0
    done = asyncio.Event()

    @farm.handler(queue=QUEUE, concurrency=CONCURRENCY)
    async def handle(msg: Message) -> None:
        nonlocal handled
        handled += 1
        if handled == rows:
            done.set()

    async def run() -> None:
        # Nothing here waits on the wall clock (which valgrind slows fifty-fold): flushes go
        # out when the fetcher runs out of slots, polls and chores do not come round.
        async with farm.running(dsn, vacuum_interval=None, poll_interval=5.0, flush_interval=5.0):
            await asyncio.wait_for(done.wait(), timeout=600)

    uvloop.run(run())


def _relay(dsn: str, rows: int) -> None:
    import uvloop

    from outbox_farm import Farm
    from outbox_farm.relay import CONFIRMED, Delivery, Envelope

    done = asyncio.Event()

    class Confirming:
        """A broker that takes every envelope at once: what is counted is the relay's side."""

        label = "confirming"
        sent = 0

        async def connect(self) -> None:
            pass

        async def close(self) -> None:
            pass

        async def publish(self, batch: list[Envelope]) -> list[Delivery]:
            self.sent += len(batch)
            if self.sent >= rows:
                done.set()
            return [CONFIRMED] * len(batch)

    farm = Farm()
    # Nothing here may run by the wall clock, which valgrind slows fifty-fold: batches are
    # cut by size (not the 5 ms linger), and the heartbeat, which extends every held row's
    # lease each lease_ttl / 3, does not come round. Either made the count per message move
    # by up to 9% between runs (how many rows a batch caught; how many heartbeats, each over
    # thousands of rows, fell within the run).
    farm.relay(QUEUE, to=Confirming(), linger=5.0, lease_ttl=3600.0)

    async def run() -> None:
        async with farm.running(dsn, vacuum_interval=None, poll_interval=5.0, flush_interval=5.0):
            await asyncio.wait_for(done.wait(), timeout=600)

    uvloop.run(run())


def _publish_batch(dsn: str, rows: int) -> None:
    from outbox_farm import Farm

    farm = Farm()
    bodies = [{"i": i, "kind": "bench"} for i in range(BATCH)]
    with psycopg.connect(dsn) as conn:
        for _ in range(rows // BATCH):
            with conn.transaction():
                farm.publish_batch(conn, bodies, queue=QUEUE)


def _publish(dsn: str, calls: int) -> None:
    from outbox_farm import Farm

    farm = Farm()
    with psycopg.connect(dsn) as conn:
        for i in range(calls):
            with conn.transaction():
                farm.publish(conn, {"i": i, "kind": "bench"}, queue=QUEUE)


WORKLOADS = {"drain": _drain, "relay": _relay, "publish_batch": _publish_batch, "publish": _publish}


def child(name: str, dsn: str, count: int) -> None:
    WORKLOADS[name](dsn, count)


# -- the parent: prepare, count, compare ----------------------------------------------------


def _reset(dsn: str, measure: Measure, count: int) -> None:
    """An empty outbox, then (for the drain) `count` due rows, analysed, as the child expects."""
    from outbox_farm import Farm

    farm = Farm()
    table = farm.names.outbox.identifier()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("TRUNCATE {}").format(table))
        if measure.preload:
            bodies = [{"i": i} for i in range(count)]
            for start in range(0, count, 1000):
                with conn.transaction():
                    farm.publish_batch(
                        conn, bodies[start : start + 1000], queue=QUEUE, notify=False
                    )
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(table))


def count_instructions(dsn: str, measure: Measure, count: int, metrics_dir: str) -> int:
    """Instructions the child executed for `count` units of `measure`."""
    _reset(dsn, measure, count)
    env = {
        **os.environ,
        "PYTHONHASHSEED": "0",
        "PROMETHEUS_MULTIPROC_DIR": metrics_dir,
    }
    for stale in Path(metrics_dir).glob("*.db"):
        stale.unlink()
    with tempfile.NamedTemporaryFile(prefix="callgrind.", suffix=".out") as out:
        done = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out.name}",
                sys.executable,
                "-m",
                "loadtests.bench.instructions",
                "--child",
                measure.name,
                "--dsn",
                dsn,
                "--count",
                str(count),
            ],
            env=env,
            capture_output=True,
            timeout=900,
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(
            f"{measure.name} ({count}) failed under callgrind (status {done.returncode}):\n"
            + done.stderr.decode(errors="replace")[-3000:]
        )
    found = COLLECTED.search(done.stderr)
    if found is None:
        raise RuntimeError(f"callgrind printed no total for {measure.name}")
    return int(found.group(1))


def per_unit(dsn: str, measure: Measure, metrics_dir: str) -> dict[str, Any]:
    started = time.perf_counter()
    small = count_instructions(dsn, measure, measure.small, metrics_dir)
    large = count_instructions(dsn, measure, measure.large, metrics_dir)
    cost = (large - small) / (measure.large - measure.small)
    return {
        "unit": measure.unit,
        "instructions": round(cost),
        "small": [measure.small, small],
        "large": [measure.large, large],
        "seconds": round(time.perf_counter() - started, 1),
    }


def compare(results: dict[str, Any], baseline: dict[str, Any], tolerance: float) -> list[str]:
    """The table lines, and the measures that regressed past `tolerance` (appended last as
    'FAIL ...' lines)."""
    lines = [f"{'measure':<14} {'instructions':>14} {'baseline':>10} {'ratio':>7}  verdict"]
    failures = []
    for name, now in results.items():
        base = baseline.get(name, {}).get("instructions")
        ratio = now["instructions"] / base if base else None
        if ratio is None:
            verdict = "no baseline"
        elif ratio > 1 + tolerance:
            verdict = f"REGRESSION (> {1 + tolerance:.2f})"
            failures.append(
                f"FAIL {name}: {now['instructions']:,} instructions per {now['unit']}, "
                f"{ratio:.3f}x the baseline's {base:,}"
            )
        elif ratio < 1 - tolerance:
            verdict = "cheaper: update the baseline (--update) in this commit"
        else:
            verdict = "ok"
        lines.append(
            f"{name:<14} {now['instructions']:>14,} {base or '-':>10,} "
            f"{'-' if ratio is None else f'{ratio:.3f}':>7}  {verdict}"
            if base
            else f"{name:<14} {now['instructions']:>14,} {'-':>10} {'-':>7}  {verdict}"
        )
    return lines + failures


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.instructions", description=__doc__.split("\n\n")[0]
    )
    add_dsn(parser)
    parser.add_argument("--baseline", type=Path, default=BASELINE)
    parser.add_argument("--update", action="store_true", help="write the results as baseline")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE)
    parser.add_argument("--only", action="append", choices=[m.name for m in MEASURES])
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--time-limit", type=float, default=600.0)
    parser.add_argument("--child", choices=sorted(WORKLOADS), help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args.child, args.dsn, args.count)
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind is not installed: apt-get install valgrind", file=sys.stderr)
        return 2
    from outbox_farm import Farm

    measures = [m for m in MEASURES if not args.only or m.name in args.only]
    results: dict[str, Any] = {}
    with (
        time_limit(args.time_limit),
        server(args.dsn) as admin,
        scratch(admin, Farm()) as dsn,
        tempfile.TemporaryDirectory(prefix="outbox-farm-metrics-") as metrics_dir,
    ):
        for measure in measures:
            note(f"counting {measure.name} ({measure.small:,} and {measure.large:,})")
            results[measure.name] = per_unit(dsn, measure, metrics_dir)
            note(
                f"  {results[measure.name]['instructions']:,} instructions per {measure.unit} "
                f"({results[measure.name]['seconds']}s)"
            )
    baseline = json.loads(args.baseline.read_text()) if args.baseline.exists() else {}
    if args.update:
        baseline.update(results)
        args.baseline.write_text(json.dumps(baseline, indent=2, sort_keys=True) + "\n")
        note(f"baseline written: {args.baseline}")
        return 0
    lines = compare(results, baseline, args.tolerance)
    if args.json:
        print(json.dumps({"results": results, "baseline": baseline}, indent=2))
    print("\n".join(lines))
    return 1 if any(line.startswith("FAIL") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
