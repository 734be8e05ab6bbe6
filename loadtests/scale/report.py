"""The summary tables printed at the end of a run, one per scenario, from its JSON summary
(so what is printed is what `--json` wrote)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loadtests.common.harness import align


def _table(head: tuple[str, ...], rows: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    lines = align([head, *rows], left=left)
    return [lines[0], "-" * len(lines[0]), *lines[1:]]


def _partition(r: dict[str, Any]) -> list[str]:
    head = ("partition", "value")
    rows = [
        ("hosts x procs", f"{r['hosts']} x {r['procs']}"),
        ("rate, lease_ttl", f"{r['rate']:g} msg/s, {r['lease_ttl']:g}s"),
        (
            "cut host, rows it held, cut for",
            f"{r['partitioned_host']}, {r['held_rows_when_cut']:g}, {r['cut_seconds']}s",
        ),
        ("published (committed)", f"{r['published']:,}"),
        ("handled (distinct)", f"{r['handled']:,}"),
        ("handler runs by host", ", ".join(f"{h} {n:,}" for h, n in r["runs_by_host"].items())),
        ("lost", str(r["lost"])),
        ("duplicates", str(r["duplicates"])),
        ("  first run on the cut host", str(r["explained_by_partition"])),
        ("  first run on a host that lost a lease", str(r["explained_by_lease_lost"])),
        ("  unexplained", str(r["unexplained_count"])),
        ("lease_lost by host", ", ".join(f"{h} {v:g}" for h, v in r["lease_lost_by_host"].items())),
        (
            "lease_lost on the cut host by phase",
            ", ".join(f"{p} {v:g}" for p, v in r["lease_lost_partitioned_by_phase"].items()) or "-",
        ),
        (
            "first takeover after the cut",
            f"{r['first_takeover_after_cut_s']}s"
            if r["first_takeover_after_cut_s"] is not None
            else "-",
        ),
        ("drained", f"{'yes' if r['drained'] else 'NO'} ({r['drain_seconds']}s)"),
        (
            "load test checker",
            "all invariants hold" if r["checker_ok"] else "; ".join(r["checker_failures"]),
        ),
    ]
    return _table(head, rows)


def _latency(r: dict[str, Any]) -> list[str]:
    head = (
        "latency: config",
        "SELECT 1 ms",
        "msg/s",
        "window",
        "lag p50 ms",
        "lag p99 ms",
        "samples",
        "published",
        "unhandled",
    )
    rows = [
        (
            row["config"],
            "-" if row["select1_ms"] is None else f"{row['select1_ms']}",
            f"{row['msg_per_s']:,}",
            f"{row['window_s']}s",
            f"{row['lag_p50_ms']}",
            f"{row['lag_p99_ms']}",
            f"{row['lag_samples']:,}",
            f"{row['published']:,}",
            str(row["unhandled"]),
        )
        for row in r["rows"]
    ]
    return [
        f"delay: {r['method']}; {r['hosts']} farm hosts x --procs {r['procs']}; lag at "
        f"{r['lag_rate']:g} msg/s, throughput from a backlog of {r['backlog']:,} over at most "
        f"{r['window_s']:g}s",
        f"clock: {r['clock']}",
        *_table(head, rows),
    ]


def _scale(r: dict[str, Any]) -> list[str]:
    head = (
        "scale: hosts",
        "procs",
        "msg/s",
        "drain s",
        "DB CPU s",
        "DB cores",
        "DB µs/msg",
        "farm CPU s",
        "machine cores",
    )
    rows = [
        (
            str(c["hosts"]),
            str(c["procs"]),
            f"{c['msg_per_s']:,}",
            f"{c['drain_s']}",
            f"{c['db_cpu_s']}",
            f"{c['db_cores']}",
            f"{c['db_cpu_us_per_msg']}",
            f"{c['farm_cpu_s']}",
            f"{c['machine_busy_cores']}",
        )
        for c in r["curve"]
    ]
    return [f"{r['rows']:,} rows, no-op handler; {r['note']}", *_table(head, rows)]


def _limits(r: dict[str, Any]) -> list[str]:
    head = ("limits", "limit", "seen", "")
    limit, per_second = r["rate_limit"], f"{r['rate_limit_per_second']:g}/s"
    limit += "" if limit == per_second else f" ({per_second})"
    rate_note = (
        f"{r['rate_error']:+.2%}, {'within' if r['rate_ok'] else 'OUTSIDE'} ±{r['tolerance']:.0%}"
    )
    most_note = f"mean {r['mean_running']:.2f}{'' if r['most_ok'] else ', ABOVE THE LIMIT'}"
    rows = [
        (
            "rated: runs begun per second",
            limit,
            f"{r['rate_seen']:.2f}/s",
            rate_note,
        ),
        (
            "narrow: most running at once",
            str(r["max_running"]),
            str(r["most_overlapping"]),
            most_note,
        ),
    ]
    shares = ", ".join(
        f"{h} {n['rated']:,}/{n['narrow']:,}" for h, n in sorted(r["runs_by_host"].items())
    )
    return [
        f"{r['hosts']} farm hosts x --procs {r['procs']}, handler runs of {r['sleep']:g}s, "
        f"{r['seconds']:g}s measured; the handlers' own records",
        *_table(head, rows),
        f"runs by host (rated/narrow): {shares}"
        + ("" if r["every_host_ran_both"] else " (A HOST RAN NONE OF A QUEUE)"),
    ]


def render(summary: dict[str, Any]) -> str:
    parts: list[str] = []
    for r in summary["scenarios"]:
        parts.append("")
        parts.append(f"== {r['scenario']}: {'PASS' if r['ok'] else 'FAIL'}")
        if "error" in r:
            parts.append(f"error: {r['error']}")
            continue
        renderers = {
            "partition": _partition,
            "latency": _latency,
            "scale": _scale,
            "limits": _limits,
        }
        parts += renderers[r["scenario"]](r)
    left = summary["leftover_namespaces"]
    parts.append("")
    parts.append(f"namespaces left behind: {', '.join(left) if left else 'none'}")
    parts.append(f"RESULT: {'PASS' if summary['ok'] else 'FAIL'} in {summary['seconds']:.0f}s")
    return "\n".join(parts)
