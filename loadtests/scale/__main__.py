"""`python -m loadtests.scale`: farms on several hosts over a network, with faults between them.

    python -m loadtests.scale                          # partition, latency, scale curve, limits
    python -m loadtests.scale --scenario latency       # one (comma-separated for several)
    python -m loadtests.scale --scenario limits        # a rate and a most running, farm-wide
    python -m loadtests.scale --smoke                  # the partition, short (CI)
    python -m loadtests.scale --smoke --json out.json  # ... and its summary for a machine
    python -m loadtests.scale --scenario fleet         # one farm, many outboxes (not by default)

Needs root (network namespaces). Exit status 0 when every scenario held, 1 when one did not,
2 when the bed could not be built (the message names what is missing).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import curve, fleet, latency, limits, partition
from .bed import Bed, build_bed, say
from .dbserver import ServerUnavailable
from .netns import NetworkUnavailable, ours
from .report import render

SCENARIOS: dict[str, Callable[[Bed, bool], dict[str, Any]]] = {
    "partition": lambda bed, smoke: partition.run(
        bed, partition.SMOKE if smoke else partition.FULL
    ),
    "latency": lambda bed, smoke: latency.run(bed, smoke),
    "scale": lambda bed, smoke: curve.run(bed, smoke),
    "limits": lambda bed, smoke: limits.run(bed),
    "fleet": lambda bed, smoke: fleet.run(bed, smoke),
}
DEFAULT = ["partition", "latency", "scale", "limits"]  # the fleet's runs only when named
# Scenarios whose table is drawn here rather than by `report.render`.
RENDERERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {"fleet": fleet.render}


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C, so that every `finally` removes what it made."""
    raise KeyboardInterrupt


def _rendered(summary: dict[str, Any]) -> str:
    """`report.render`'s summary, with the tables of the scenarios it does not draw before
    its closing lines (namespaces left behind, the result)."""
    ours = [r for r in summary["scenarios"] if r["scenario"] in RENDERERS and "error" not in r]
    others = [r for r in summary["scenarios"] if r not in ours]
    lines = render({**summary, "scenarios": others}).split("\n")
    extra: list[str] = []
    for r in ours:
        extra += ["", f"== {r['scenario']}: {'PASS' if r['ok'] else 'FAIL'}"]
        extra += RENDERERS[r["scenario"]](r)
    return "\n".join([*lines[:-3], *extra, *lines[-3:]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.scale", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--scenario", default="", help=f"comma-separated, of: {', '.join(SCENARIOS)}"
    )
    parser.add_argument("--smoke", action="store_true", help="the partition scenario, short (CI)")
    parser.add_argument("--json", type=Path, help="write the summary as JSON to this file")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, journals)")
    args = parser.parse_args(argv)
    names = [n for n in args.scenario.split(",") if n] or (["partition"] if args.smoke else DEFAULT)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    began = time.monotonic()
    results: list[dict[str, Any]] = []
    try:
        with build_bed(3, keep=args.keep) as bed:
            for name in names:
                say(f"{name} ...")
                try:
                    result = SCENARIOS[name](bed, args.smoke)
                except Exception as exc:  # a scenario that could not run fails, named
                    traceback.print_exc()
                    result = {"scenario": name, "ok": False, "error": repr(exc)}
                say(f"{name}: {'PASS' if result['ok'] else 'FAIL'}")
                results.append(result)
    except (NetworkUnavailable, ServerUnavailable) as exc:
        say(f"cannot build the hosts: {exc}")
        return 2
    except KeyboardInterrupt:
        say("interrupted: the hosts were removed")
        return 130
    leftover = ours()
    summary = {
        "ok": all(r["ok"] for r in results) and not leftover,
        "smoke": args.smoke,
        "seconds": round(time.monotonic() - began, 1),
        "leftover_namespaces": leftover,
        "scenarios": results,
    }
    print(_rendered(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2, default=str))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
