"""The latency tail beside its floor: commit -> handler start of the farm's runtime and of the
raw LISTEN + claim loop (`latency.raw_latency`), the same producer for both, in alternating
runs at each offered rate, and where the farm's time goes, stage by stage.

    python -m loadtests.bench.tail --dsn "host=127.0.0.1 user=postgres dbname=postgres"
    python -m loadtests.bench.tail --rates 200 --runs 9 --json

Each run is one `latency.latency` (the runtime in this process, idle between messages) and one
`latency.raw_latency`, the order swapped every run, so a busy spell of the machine falls on both
as often. The verdict reads the median, over the runs, of each run's farm ÷ raw at p50, p95 and
p99: the machine moves both numbers of one run together far more than it moves their ratio.

Then one traced run of the farm per rate splits each message's time at the moments the runtime
saw it: its NOTIFY arriving on the listener, the claim that took it being sent and returning,
its handler starting. The stages are timed by wrapping the runtime's own `listener.on_notify`
and `store.claim` (a few microseconds each), so the traced run's total is a little above the
untraced runs'. A message whose claim was not woken by its own NOTIFY (a claim already under
way took it) has no notify stages.
"""

from __future__ import annotations

import bisect
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson
import uvloop

from loadtests.common import tables
from loadtests.common.harness import note
from outbox_farm import Farm, Message
from outbox_farm.storage import Claim

from .common import QUEUE, percentiles, scratch, server, time_limit, turns_parser, write_json
from .latency import Latency, frozen_boot, latency, measure, raw_latency
from .report import print_measures, verdict

TARGET_P50 = 1.15  # farm ÷ raw, median over the runs
TARGET_TAIL = 1.25  # idem at p95 and p99
CONCURRENCY = 64  # executors, as the standard report's latency phase
CUTS = ("p50_ms", "p95_ms", "p99_ms")


@dataclass
class Pair:
    """One run: the farm and the raw loop, and which went first."""

    farm: Latency
    raw: Latency
    farm_first: bool

    def ratios(self) -> tuple[float, ...]:
        return tuple(
            getattr(self.farm, cut) / getattr(self.raw, cut) if getattr(self.raw, cut) else 0.0
            for cut in CUTS
        )


@dataclass
class Stages:
    """Where the traced run's messages spent their time, ms at p50/p95/p99 per stage."""

    messages: int = 0
    claims: int = 0
    empty_claims: int = 0
    stages: dict[str, tuple[float, float, float]] = field(default_factory=dict)


async def run_pairs(dsn: str, rate: float, messages: int, runs: int, budget: float) -> list[Pair]:
    pairs = []
    for run in range(runs):
        farm_first = run % 2 == 0
        note(f"  {rate:g} msg/s, run {run + 1}/{runs} ({'farm' if farm_first else 'raw'} first)")
        if farm_first:
            farm = await latency(dsn, messages, rate, CONCURRENCY, budget)
            raw = await raw_latency(dsn, messages, rate, budget)
        else:
            raw = await raw_latency(dsn, messages, rate, budget)
            farm = await latency(dsn, messages, rate, CONCURRENCY, budget)
        if not (farm.completed and raw.completed):
            raise SystemExit(f"a latency run at {rate:g} msg/s did not finish in {budget:g}s")
        pairs.append(Pair(farm, raw, farm_first))
    return pairs


class Trace:
    """The moments the runtime saw each message, recorded by wrapping its listener's callback
    and its store's claim."""

    def __init__(self) -> None:
        self.notifies: list[float] = []  # time.time() of each NOTIFY, in order
        self.claims: list[tuple[float, float, list[int]]] = []  # sent, returned, row ids
        self.starts: dict[int, tuple[float, int]] = {}  # message number: handler start, row id

    def stages(self, commits: dict[int, float], n: int) -> Stages:
        claimed = {row: (sent, back) for sent, back, rows in self.claims for row in rows}
        spans: dict[str, list[float]] = {
            "commit -> NOTIFY on the listener": [],
            "NOTIFY -> claim sent": [],
            "claim sent -> rows back": [],
            "rows back -> handler start": [],
            "commit -> handler start": [],
        }
        counted = 0
        for i in range(n):
            if i not in self.starts or i not in commits or self.starts[i][1] not in claimed:
                continue
            counted += 1
            committed, (started, row) = commits[i], self.starts[i]
            sent, back = claimed[row]
            spans["claim sent -> rows back"].append(back - sent)
            spans["rows back -> handler start"].append(started - back)
            spans["commit -> handler start"].append(started - committed)
            # The last NOTIFY before the claim went out, if it came after this commit.
            k = bisect.bisect_right(self.notifies, sent) - 1
            if k >= 0 and self.notifies[k] >= committed:
                spans["commit -> NOTIFY on the listener"].append(self.notifies[k] - committed)
                spans["NOTIFY -> claim sent"].append(sent - self.notifies[k])
        found = Stages(
            messages=counted,
            claims=len(self.claims),
            empty_claims=sum(1 for _, _, rows in self.claims if not rows),
        )
        for name, values in spans.items():
            cuts = percentiles([v * 1000 for v in values], 50, 95, 99)
            if cuts is not None:
                found.stages[name] = (cuts[0], cuts[1], cuts[2])
        return found


def _traced(dsn: str, trace: Trace) -> Callable[..., Any]:
    @asynccontextmanager
    async def receiver(note_start: Callable[[int, float], None]) -> AsyncIterator[None]:
        farm = Farm()

        @farm.handler(QUEUE, concurrency=CONCURRENCY)
        async def handle(msg: Message) -> None:
            now = time.time()
            i = orjson.loads(msg.body)["i"]
            trace.starts[i] = (now, msg.id)
            note_start(i, now)

        async with farm.running(dsn) as runtime, frozen_boot():
            listener, store = runtime.listener, runtime.store
            assert listener is not None
            assert store is not None
            await listener.connected.wait()
            on_notify, claim = listener.on_notify, store.claim

            def noted(payload: str) -> None:
                trace.notifies.append(time.time())
                on_notify(payload)

            async def timed(request: Claim) -> list[Message]:
                sent = time.time()
                msgs = await claim(request)
                trace.claims.append((sent, time.time(), [msg.id for msg in msgs]))
                return msgs

            listener.on_notify = noted
            store.claim = timed  # type: ignore[method-assign,assignment]
            yield

    return receiver


async def traced_run(dsn: str, rate: float, messages: int, budget: float) -> Stages:
    trace = Trace()
    commits: dict[int, float] = {}
    result = await measure(
        dsn, messages, rate, CONCURRENCY, budget, _traced(dsn, trace), commits=commits
    )
    if not result.completed:
        raise SystemExit(f"the traced run at {rate:g} msg/s did not finish in {budget:g}s")
    return trace.stages(commits, messages)


def medians(pairs: list[Pair]) -> tuple[float, ...]:
    return tuple(statistics.median(pair.ratios()[k] for pair in pairs) for k in range(3))


def print_rate(rate: float, pairs: list[Pair], stages: Stages | None) -> None:
    print(f"\ncommit -> handler start at {rate:g} msg/s, ms p50 / p95 / p99")
    print(f"{'run':>4}  {'first':5}  {'farm':>22}  {'raw loop':>22}  {'farm ÷ raw':>20}")
    for k, pair in enumerate(pairs, 1):
        farm = " / ".join(f"{getattr(pair.farm, c):.2f}" for c in CUTS)
        raw = " / ".join(f"{getattr(pair.raw, c):.2f}" for c in CUTS)
        ratio = " / ".join(f"{r:.2f}" for r in pair.ratios())
        print(
            f"{k:>4}  {'farm' if pair.farm_first else 'raw':5}  {farm:>22}  {raw:>22}  {ratio:>20}"
        )
    if stages is not None:
        print(
            f"  traced farm run: {stages.messages} messages, {stages.claims} claims "
            f"({stages.empty_claims} empty)"
        )
        for name, (p50, p95, p99) in stages.stages.items():
            print(f"    {name:36} {p50:6.3f} / {p95:6.3f} / {p99:6.3f}")
    p50, p95, p99 = medians(pairs)
    print_measures(
        [
            (
                f"farm ÷ raw at {rate:g} msg/s, p50",
                f"{p50:.2f}",
                f"<= {TARGET_P50}",
                verdict(p50 <= TARGET_P50),
            ),
            (
                f"farm ÷ raw at {rate:g} msg/s, p95",
                f"{p95:.2f}",
                f"<= {TARGET_TAIL}",
                verdict(p95 <= TARGET_TAIL),
            ),
            (
                f"farm ÷ raw at {rate:g} msg/s, p99",
                f"{p99:.2f}",
                f"<= {TARGET_TAIL}",
                verdict(p99 <= TARGET_TAIL),
            ),
        ],
        widths=(36, 8, 8),
    )


def main(argv: list[str] | None = None) -> int:
    parser = turns_parser("python -m loadtests.bench.tail", __doc__)
    parser.add_argument("--no-stages", action="store_true", help="skip the traced run")
    args = parser.parse_args(argv)
    rates: list[float] = args.rates
    results: dict[str, Any] = {}
    with (
        time_limit(120 + len(rates) * (2 * args.runs + 1) * (args.seconds + 15)),
        server(args.dsn) as admin,
        scratch(admin, Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)) as dsn,
    ):
        for rate in rates:
            messages = max(1_000, int(rate * args.seconds))
            budget = messages / rate + 60
            pairs = uvloop.run(run_pairs(dsn, rate, messages, args.runs, budget))
            stages = None
            if not args.no_stages:
                note(f"  {rate:g} msg/s, traced farm run")
                stages = uvloop.run(traced_run(dsn, rate, messages, budget))
            results[f"{rate:g}"] = {
                "messages": messages,
                "runs": [
                    {"farm": asdict(p.farm), "raw": asdict(p.raw), "farm_first": p.farm_first}
                    for p in pairs
                ],
                "median_ratio": dict(zip(CUTS, medians(pairs), strict=True)),
                "stages": None if stages is None else asdict(stages),
            }
            if not args.json:
                print_rate(rate, pairs, stages)
    if args.json:
        write_json("-", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
