"""The standard report's measurements: producer throughput, the drain by `outbox-farm start
--procs 1` and `--procs 2` with its cost to the database, and commit->handler latency.

Database cost is read from the server's own statistics around the drain, never estimated:
statements (pg_stat_database transactions, our own polls subtracted), WAL bytes (LSN
difference) and dead row versions made (pg_stat_user_tables' updates + deletes).
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psycopg
import uvloop

from loadtests.common import tables
from loadtests.common.harness import dbname
from outbox_farm import Farm
from outbox_farm.metrics import metrics

from . import publish
from .common import Progress, outbox_stats, scratch, server_info, settled_xacts
from .farm import APP, TARGET_DRAIN_2, drain_run
from .floor import floor_run
from .latency import latency, raw_latency
from .report import Row, print_measures, verdict

TARGET_STATEMENTS = 0.05
TARGET_OF_FLOOR = 0.75  # the --procs 2 drain against the raw claim/delete floor
TARGET_P99_MS = 10.0


def table_stats(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return outbox_stats(conn)


def producer_section(dsn: str, farm: Farm, n: int, budget: float, progress: Progress) -> list:
    progress.step("producer raw-SQL baseline (1 msg/txn)")
    raw = publish.single_phase(
        dsn, farm, "raw_one", n, budget, "raw_one", "raw INSERT+pg_notify, 1 msg/txn", None
    )
    progress.step("producer publish, 1 producer")
    one = publish.single_phase(
        dsn, farm, "publish", n, budget, "a_publish", "publish 1 msg/txn, 1 producer", None
    )
    progress.step("producer publish, 8 producers")
    eight = publish.concurrent_phase(
        dsn, farm, n, 8, budget, "b_publish_concurrent", "publish 1 msg/txn, 8 producers"
    )
    floors = []
    for mode in publish.RAW_BATCH_MODES:
        progress.step(f"producer raw-SQL batches of 100 ({mode})")
        floors.append(publish.batch_phase(dsn, farm, n * 2, 100, budget, mode=mode))
    progress.step("producer publish_batch of 100")
    batch = publish.batch_phase(dsn, farm, n * 2, 100, budget)
    for phase in (one, eight):
        phase.extra["raw_baseline_msg_s"] = round(raw.rate, 1)
    return [raw, one, eight, *floors, batch]


def drain_section(admin_dsn: str, dsn: str, procs: int, rows: int, appdir: Path) -> dict[str, Any]:
    before: dict[str, Any] = {}
    name = dbname(dsn)
    with psycopg.connect(admin_dsn, autocommit=True) as admin:

        def readings() -> None:
            before["stats"] = table_stats(dsn)  # first: its transaction is inside "before"
            before["xacts"] = settled_xacts(admin, name)
            before["lsn"] = admin.execute("SELECT pg_current_wal_lsn()").fetchone()[0]

        run = drain_run(dsn, procs, rows, appdir, on_loaded=readings)
        # drain_run returns after the arbiter exited; its workers have closed their sessions.
        wal = admin.execute(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)", [before["lsn"]]
        ).fetchone()[0]
        xacts = settled_xacts(admin, name) - before["xacts"]
        stats = table_stats(dsn)  # after the count: its own transaction is not in it
    statements = xacts - run["polls"]
    drained = run["rows_at_start"]
    made = stats["dead_made"] - before["stats"]["dead_made"]
    return {
        "procs": procs,
        "rows": rows,
        "rate_msg_s": run["rate"],
        "seconds": run["seconds"],
        "worker_cpu_us_per_message": round(run["worker_cpu_us_per_message"], 1),
        "machine_cpu_us_per_message": round(run["machine_cpu_us_per_message"], 1),
        "statements": statements,
        "statements_per_message": statements / rows,
        "wal_bytes": int(wal),
        "wal_bytes_per_message": float(wal) / rows,
        "dead_tuples_made": made,
        "dead_tuples_per_message": made / rows,
        "dead_tuples_left": stats["n_dead_tup"],
        "farm_vacuums": stats["vacuum_count"] - before["stats"]["vacuum_count"],
        "autovacuums": stats["autovacuum_count"] - before["stats"]["autovacuum_count"],
        "rows_counted_at_start": drained,
    }


def standard(args: argparse.Namespace, admin_dsn: str) -> dict[str, Any]:
    farm = Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)
    progress = Progress(6 + 2 * 3 + 2 + 2 + 2)
    metrics()  # Prometheus objects once, before the in-process runtime
    result: dict[str, Any] = {}
    with scratch(admin_dsn, farm) as dsn:
        result["server"] = server_info(dsn)
        phases = producer_section(dsn, farm, args.messages, args.phase_timeout, progress)
        result["producer"] = [
            asdict(ph) | {"seconds": round(ph.seconds, 3), "rate": round(ph.rate, 1)}
            for ph in phases
        ]
        publish.reset_table(dsn, farm)
        result["drain"] = []
        with tempfile.TemporaryDirectory() as folder:
            appdir = Path(folder)
            (appdir / "benchapp.py").write_text(APP)
            for procs in (1, 2):
                progress.step(f"drain procs {procs}", 3)
                result["drain"].append(drain_section(admin_dsn, dsn, procs, args.rows, appdir))
        progress.step("drain floor: raw claim and delete", 2)
        result["floor"] = floor_run(dsn, args.rows)
        # Each latency phase from an empty table, as the producer phases: the drains leave
        # dead rows behind (autovacuum may be off), which the first phase would claim over.
        publish.reset_table(dsn, farm)
        progress.step(f"latency at {args.latency_rate:g} msg/s", 2)
        lat = uvloop.run(
            latency(dsn, args.latency_messages, args.latency_rate, 64, args.phase_timeout)
        )
        result["latency"] = asdict(lat) | {
            "runner": "in-process runtime (farm.running), spawned producer process"
        }
        publish.reset_table(dsn, farm)
        progress.step("latency floor: raw LISTEN + claim loop", 2)
        raw = uvloop.run(
            raw_latency(dsn, args.latency_messages, args.latency_rate, args.phase_timeout)
        )
        result["latency_floor"] = asdict(raw) | {
            "runner": "raw LISTEN connection + claim/DELETE connection, same producer"
        }
        progress.show("done")
    return result


def standard_rows(r: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    prod = {p["name"]: p for p in r["producer"]}
    raw = prod["raw_one"]["rate"]
    rows.append(("producer: raw SQL baseline, 1 msg/txn", f"{raw:,.0f} msg/s", "-", ""))
    for key in ("a_publish", "b_publish_concurrent"):
        p = prod[key]
        rows.append(
            (
                f"producer: {p['label']} (raw {raw:,.0f})",
                f"{p['rate']:,.0f} msg/s",
                f">= {publish.TARGET_ONE_PER_TXN:,.0f}",
                verdict(p["rate"] >= publish.TARGET_ONE_PER_TXN),
            )
        )
    b = prod["c_publish_batch"]
    rows.append(
        (
            "producer: publish_batch of 100, 1 producer",
            f"{b['rate']:,.0f} rows/s",
            f">= {publish.TARGET_BATCH:,.0f}",
            verdict(b["rate"] >= publish.TARGET_BATCH),
        )
    )
    # The raw floor of publish_batch: the better of its two ways, in the same run.
    floors = {
        way: prod[publish.BATCH_MODES[mode][0]]
        for mode, way in publish.RAW_BATCH_MODES.items()
        if publish.BATCH_MODES[mode][0] in prod
    }
    if floors:
        way, floor = max(floors.items(), key=lambda item: item[1]["rate"])
        ratio = b["rate"] / floor["rate"]
        rows.append(
            (
                f"  / raw floor ({way}, {floor['rate']:,.0f} rows/s)",
                f"{ratio:.2f}",
                f">= {publish.TARGET_OF_BATCH_FLOOR:.2f}",
                verdict(ratio >= publish.TARGET_OF_BATCH_FLOOR),
            )
        )
    for d in r["drain"]:
        target = TARGET_DRAIN_2 if d["procs"] == 2 else None
        rows.append(
            (
                f"drain: start --procs {d['procs']}, {d['rows']:,} rows, no-op",
                f"{d['rate_msg_s']:,.0f} msg/s",
                f">= {target:,.0f}" if target else "-",
                verdict(None if target is None else d["rate_msg_s"] >= target),
            )
        )
        rows.append(
            (
                "  CPU µs / message: workers / whole machine (database included)",
                f"{d['worker_cpu_us_per_message']:.1f} / {d['machine_cpu_us_per_message']:.1f}",
                "-",
                "",
            )
        )
        rows.append(
            (
                "  statements / message",
                f"{d['statements_per_message']:.4f}",
                f"<= {TARGET_STATEMENTS}",
                verdict(d["statements_per_message"] <= TARGET_STATEMENTS),
            )
        )
        rows.append(("  WAL bytes / message", f"{d['wal_bytes_per_message']:,.0f}", "-", ""))
        rows.append(
            (
                "  dead tuples made / message (updates + deletes)",
                f"{d['dead_tuples_per_message']:.3f}",
                "-",
                "",
            )
        )
        rows.append(
            (
                "  dead tuples left / VACUUMs by farm / autovacuums",
                f"{d['dead_tuples_left']:,} / {d['farm_vacuums']} / {d['autovacuums']}",
                "-",
                "",
            )
        )
    floor = r.get("floor")
    if floor is not None:
        rows.append(
            (
                f"drain floor: raw claim + DELETE, {floor['clients']} connections",
                f"{floor['rate']:,.0f} msg/s",
                "-",
                "",
            )
        )
        two = next(d for d in r["drain"] if d["procs"] == 2)
        share = two["rate_msg_s"] / floor["rate"]
        rows.append(
            (
                "  start --procs 2 / floor",
                f"{share:.2f}",
                f">= {TARGET_OF_FLOOR}",
                verdict(share >= TARGET_OF_FLOOR),
            )
        )
    lat = r["latency"]
    tag = f"latency commit->handler at {lat['rate']:g} msg/s"
    rows.append((f"{tag} p50 ms", f"{lat['p50_ms']:.2f}", "-", ""))
    rows.append(("  p95 ms", f"{lat['p95_ms']:.2f}", "-", ""))
    rows.append(
        (
            "  p99 ms",
            f"{lat['p99_ms']:.2f}",
            f"<= {TARGET_P99_MS:g}",
            verdict(lat["completed"] and lat["p99_ms"] <= TARGET_P99_MS),
        )
    )
    raw = r.get("latency_floor")
    if raw and raw["completed"] and raw["p50_ms"] > 0:
        cuts = " / ".join(f"{raw[k]:.2f}" for k in ("p50_ms", "p95_ms", "p99_ms"))
        rows.append(("  floor, raw LISTEN + claim loop: p50 / p95 / p99 ms", cuts, "-", ""))
        ratios = " / ".join(f"{lat[k] / raw[k]:.2f}" for k in ("p50_ms", "p95_ms", "p99_ms"))
        rows.append(("  farm / floor: p50 / p95 / p99", ratios, "-", ""))
    return rows


def print_standard(result: dict[str, Any]) -> None:
    info = result["server"]
    print(
        f"outbox_farm standard report: PostgreSQL {info['server_version']}, "
        f"synchronous_commit={info['synchronous_commit']}, autovacuum={info['autovacuum']}, "
        f"{info['cpus']} CPUs; {result['total_seconds']:.0f} s"
    )
    print_measures(standard_rows(result))
