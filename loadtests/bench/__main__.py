"""The standard outbox_farm performance report (producer, drain, latency, database cost).

    python -m loadtests.bench --dsn "host=127.0.0.1 user=postgres dbname=postgres"
    python -m loadtests.bench --dsn ... --json            # the same as JSON on stdout
    python -m loadtests.bench --dsn ... --sustained 120   # steady load, per-window report

The standard report (`standard.py`) runs the producer phases (`publish.py`), the
`outbox-farm start` drain (`farm.py`) and the commit->handler latency (`latency.py`);
--sustained runs `sustained.py` instead. Everything runs in a scratch database
`outbox_farm_bench_<random>` dropped WITH (FORCE) at the end; loopback only; every wait is
bounded, and the whole run by --time-limit. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time

from .common import add_dsn, add_limits, server, time_limit, write_json
from .standard import print_standard, standard
from .sustained import print_sustained, sustained


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench", description=__doc__.split("\n\n")[0]
    )
    add_dsn(parser)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--messages", type=int, default=10_000, help="per producer phase")
    parser.add_argument("--rows", type=int, default=50_000, help="pre-loaded rows per drain")
    parser.add_argument("--latency-messages", type=int, default=2_500)
    parser.add_argument("--latency-rate", type=float, default=500.0)
    add_limits(
        parser, phase_timeout=30.0, time_limit=0, time_limit_help="0: 280 s, or sustained+90"
    )
    parser.add_argument("--sustained", type=float, default=0, metavar="SECONDS")
    parser.add_argument(
        "--rate", type=float, default=5_000.0, help="--sustained offered load, msg/s"
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="--sustained: then the same load to raw LISTEN + claim loops, beside the farm's",
    )
    parser.add_argument(
        "--vacuum-interval",
        type=float,
        default=None,
        help="--sustained: the farm's --vacuum-interval (default: the farm's own; 0: autovacuum "
        "alone, to see what the farm's VACUUM buys)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sustained_limit = args.sustained * (2 if args.floor else 1) + 90
    limit = args.time_limit or (sustained_limit if args.sustained else 280)
    with time_limit(limit), server(args.dsn) as admin:
        started = time.perf_counter()
        result = (sustained if args.sustained else standard)(args, admin)
        result["total_seconds"] = round(time.perf_counter() - started, 1)
    if args.json:
        write_json("-", result)
    elif args.sustained:
        print_sustained(result)
    else:
        print_standard(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
