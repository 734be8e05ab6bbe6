"""`python -m loadtests.chaos` (`make chaos`): the chaos and scale suite, one table at the end.

    python -m loadtests.chaos                          # every scenario
    python -m loadtests.chaos --scenario pg-restart    # one (comma-separated for several)
    python -m loadtests.chaos --smoke                  # two short ones (what CI runs)

Each scenario creates a scratch database beside --dsn's (default: the local server, else an
embedded one), runs `outbox-farm start` under steady load, does its fault, drains, and runs the
checker. Exit status 1 when any invariant broke; each failure is printed as `scenario:
invariant: detail`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path

from loadtests.common.harness import admin_server, align, note

from .checks import Context, Finding, Result
from .scenarios import SCENARIOS

SMOKE = ("worker-kill", "pg-terminate")
LOCAL = "host=127.0.0.1 user=postgres dbname=postgres"


def table(results: list[Result]) -> str:
    head = (
        "scenario",
        "verdict",
        "published",
        "handled",
        "dups",
        "explained",
        "lost",
        "recovery",
        "notes",
    )
    rows = [head]
    for r in results:
        rows.append(
            (
                r.scenario,
                "PASS" if r.ok else "FAIL",
                f"{r.published:,}",
                f"{r.handled:,}",
                str(r.duplicates),
                "all" if r.explained else "NO",
                str(r.lost),
                f"{r.recovery:.1f}s" if r.recovery is not None else "-",
                r.note,
            )
        )
    lines = align(rows, left=2)
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def run(name: str, ctx: Context) -> Result:
    began = time.monotonic()
    note(f"chaos: {name} ...")
    try:
        result = SCENARIOS[name](ctx)
    except Exception as exc:  # a scenario that could not run is a failure of it, named
        result = Result(name, findings=[Finding("ran-to-the-end", False, repr(exc))])
        traceback.print_exc()
    verdict = "PASS" if result.ok else "FAIL: " + ", ".join(f.name for f in result.failures())
    note(f"chaos: {name} {verdict} ({time.monotonic() - began:.0f}s)")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.chaos", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--dsn", help="admin DSN (default: the local server, else embedded)")
    parser.add_argument(
        "--scenario", default="", help=f"comma-separated, of: {', '.join(SCENARIOS)}"
    )
    parser.add_argument("--smoke", action="store_true", help=f"{', '.join(SMOKE)}, shortened")
    parser.add_argument("--scale", type=float, help="duration factor (default 1; smoke 0.3)")
    args = parser.parse_args(argv)
    names = [n for n in args.scenario.split(",") if n] or list(SMOKE if args.smoke else SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    scale = args.scale if args.scale is not None else (0.3 if args.smoke else 1.0)
    began = time.monotonic()
    with (
        admin_server(args.dsn, [LOCAL]) as admin,
        tempfile.TemporaryDirectory(prefix="outbox-farm-chaos-") as work,
    ):
        ctx = Context(admin, Path(work), scale)
        results = [run(name, ctx) for name in names]
    print()
    print(table(results))
    failures = [(r.scenario, f) for r in results for f in r.failures()]
    for scenario, finding in failures:
        print(f"FAILED {scenario}: {finding.name}: {finding.detail}")
    print(
        f"\n{len(results) - len({s for s, _ in failures})} of {len(results)} scenarios "
        f"passed in {time.monotonic() - began:.0f}s (python -m loadtests.chaos "
        f"{' '.join(argv if argv is not None else sys.argv[1:])})".rstrip()
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
