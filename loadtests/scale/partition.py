"""Partition: one farm host cut off from the database (and everything else) while it holds
rows, under steady load, then healed.

What must happen: the other hosts claim its rows once their leases expire and run them; the
cut-off host, which goes on running the rows it held, finds on healing that its acks are
refused by the lease token (it counts `lease_lost`); and the load test's checker finds nothing
lost and every duplicate explained. A duplicate (a message run more than once) is explained
here, one by one, when its first run was on the cut-off host or on a host that counted a lost
lease; and in all, by the checker, when there are no more of them than lost leases plus
unconfirmed outcomes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import psycopg

from loadtests.common import checker
from loadtests.common.drain import wait_for_drain
from loadtests.common.harness import Metrics
from loadtests.common.invariants import Report
from loadtests.common.waits import wait_until

from .bed import (
    Bed,
    Run,
    by_host,
    database,
    farms,
    load_ledger,
    merged,
    outbox_rows,
    read_commits,
    read_journals,
    say,
    scraped,
)
from .hosts import FarmHost, finish, producer


@dataclass(frozen=True)
class Plan:
    hosts: int
    procs: int
    rate: float  # messages per second, steady
    load: float  # seconds of load
    cut_at: float  # seconds into the load
    cut_for: float  # seconds: several leases
    lease: float  # the queue's lease_ttl
    sleep: tuple[float, float]  # each handler run's length, uniform
    drain: float = 120.0


FULL = Plan(hosts=3, procs=2, rate=150, load=45, cut_at=10, cut_for=15, lease=5, sleep=(0.2, 1.0))
SMOKE = Plan(hosts=2, procs=1, rate=40, load=16, cut_at=4, cut_for=8, lease=3, sleep=(0.2, 0.6))


def _progress(
    t0: float, runs: list[FarmHost], cut: FarmHost | None, conn: psycopg.Connection[Any]
) -> None:
    acked = []
    for run in runs:
        if run is cut:
            acked.append(f"{run.host.role}=cut")
            continue
        scrape = run.scrape(timeout=2)
        value = scrape.total("outbox_farm_acked_total") if scrape else float("nan")
        acked.append(f"{run.host.role}={value:g}")
    say(
        f"partition t={time.monotonic() - t0:4.0f}s outbox={outbox_rows(conn)} "
        f"acked {' '.join(acked)}"
    )


def _phase(
    seconds: float,
    t0: float,
    runs: list[FarmHost],
    cut: FarmHost | None,
    conn: psycopg.Connection[Any],
) -> None:
    """Let `seconds` of load pass (the load's own pace, not a wait for an outcome), a progress
    line every 2 s."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(2.0, left))
        _progress(t0, runs, cut, conn)


def explain(runs: list[Run], victim: str, lost_by_host: dict[str, float]) -> dict[str, Any]:
    """Each duplicated message's first run: on the cut-off host, or on a host that lost a
    lease, explains it; anything else does not."""
    per_msg: dict[str, list[Run]] = {}
    for run in runs:
        per_msg.setdefault(run.msg_id, []).append(run)
    dups = {m: sorted(rs, key=lambda r: r.started) for m, rs in per_msg.items() if len(rs) > 1}
    by_partition = by_lease = 0
    unexplained = []
    for msg_id, ordered in dups.items():
        first = ordered[0].host
        if first == victim:
            by_partition += 1
        elif lost_by_host.get(first, 0) > 0:
            by_lease += 1
        else:
            unexplained.append(msg_id)
    return {
        "duplicates": sum(len(rs) - 1 for rs in dups.values()),
        "duplicated_messages": len(dups),
        "explained_by_partition": by_partition,
        "explained_by_lease_lost": by_lease,
        "unexplained": unexplained[:5],
        "unexplained_count": len(unexplained),
    }


def run(bed: Bed, plan: Plan) -> dict[str, Any]:
    env = {
        "SCALE_JOURNAL": str(bed.work / "partition-journal"),
        "SCALE_SLEEP": f"{plan.sleep[0]},{plan.sleep[1]}",
        "SCALE_LEASE_TTL": str(plan.lease),
    }
    (bed.work / "partition-journal").mkdir()
    commits = bed.work / "partition-commits.tsv"
    with (
        database(bed) as dsn,
        psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn,
        farms(bed, dsn, plan.hosts, plan.procs, env, name="partition") as runs,
    ):
        victim = runs[0]
        say(
            f"partition: {plan.hosts} farm hosts x --procs {plan.procs}, {plan.rate:g} msg/s for "
            f"{plan.load:g}s, lease_ttl {plan.lease:g}s, "
            f"runs of {plan.sleep[0]:g}-{plan.sleep[1]:g}s; "
            f"{victim.host.role} cut at {plan.cut_at:g}s for {plan.cut_for:g}s"
        )
        t0 = time.monotonic()
        with producer(
            bed.producer, dsn, commits, "--rate", str(plan.rate), "--seconds", str(plan.load)
        ) as prod:
            _phase(plan.cut_at, t0, runs, None, conn)
            inflight: list[float] = [0.0]

            def holds_rows() -> bool:
                scrape = victim.scrape(timeout=2)
                inflight[0] = scrape.total("outbox_farm_inflight") if scrape else 0.0
                return inflight[0] > 0

            held = wait_until(holds_rows, timeout=10)
            cut_at = time.time()
            try:
                victim.host.cut()
                say(f"partition: {victim.host.role} CUT (link down) holding {inflight[0]:g} rows")
                _phase(plan.cut_for, t0, runs, victim, conn)
            finally:
                victim.host.heal()
            healed_at = time.time()
            say(f"partition: {victim.host.role} HEALED after {healed_at - cut_at:.1f}s")
            published = finish(prod, timeout=plan.load + 60)
        say(
            f"partition: load done, {published['committed']:.0f} committed; "
            "waiting for the late acks"
        )

        def refused() -> bool:
            scrape = victim.scrape(timeout=2)
            return bool(scrape and scrape.total("outbox_farm_lease_lost_total") > 0)

        saw_refusal = wait_until(refused, timeout=90, every=1.0)
        drain = wait_for_drain(conn, scraped(runs), plan.drain, say=say)
        scrapes = {r.host.role: r.scrape() for r in runs}
        stops = {r.host.role: r.stop() for r in runs}
        journal = read_journals(bed.work / "partition-journal")
        load_ledger(conn, journal)
        metrics = merged(list(scrapes.values()))
        report = checker.check(conn, metrics)
        expected_rows = conn.execute("SELECT count(*) FROM loadtest_expected").fetchone()
    return _summary(
        plan,
        victim,
        held,
        inflight[0],
        saw_refusal,
        drain.drained,
        drain.seconds,
        published,
        int(expected_rows[0]) if expected_rows else -1,
        journal,
        scrapes,
        stops,
        report,
        cut_at,
        healed_at,
        read_commits(commits),
    )


def _summary(
    plan: Plan,
    victim: FarmHost,
    held: bool,
    inflight: float,
    saw_refusal: bool,
    drained: bool,
    drain_s: float,
    published: dict[str, float],
    expected_rows: int,
    journal: list[Run],
    scrapes: dict[str, Metrics | None],
    stops: dict[str, int | None],
    report: Report,
    cut_at: float,
    healed_at: float,
    commits: dict[str, float],
) -> dict[str, Any]:
    name = victim.host.role
    lost_by_host = {
        role: (s.total("outbox_farm_lease_lost_total") if s else 0.0) for role, s in scrapes.items()
    }
    victim_scrape = scrapes[name]
    phases = victim_scrape.by("outbox_farm_lease_lost_total", "phase") if victim_scrape else {}
    handled = {r.msg_id for r in journal}
    lost = [m for m in commits if m not in handled]
    dups = explain(journal, name, lost_by_host)
    hosts = by_host(journal)
    earliest: dict[str, Run] = {}
    for r in journal:
        if r.msg_id not in earliest or r.started < earliest[r.msg_id].started:
            earliest[r.msg_id] = r
    first_on_victim = {m for m, r in earliest.items() if r.host == name}
    takeovers = sorted(
        r.started
        for r in journal
        if r.host != name and r.msg_id in first_on_victim and r.started > cut_at
    )
    checks = {c.name: c.ok for c in report.checks if not c.skipped}
    ok = (
        drained
        and held
        and not lost
        and dups["unexplained_count"] == 0
        and lost_by_host.get(name, 0) > 0
        and report.ok
        and published.get("committed", 0) == expected_rows
        and all(status == 0 for status in stops.values())
    )
    return {
        "scenario": "partition",
        "ok": ok,
        "hosts": plan.hosts,
        "procs": plan.procs,
        "rate": plan.rate,
        "lease_ttl": plan.lease,
        "partitioned_host": name,
        "held_rows_when_cut": inflight,
        "cut_seconds": round(healed_at - cut_at, 1),
        "published": int(published.get("committed", 0)),
        "publish_failures": int(published.get("failed", 0)),
        "expected_rows": expected_rows,
        "handled": len(handled),
        "runs": len(journal),
        "runs_by_host": {h: len(rs) for h, rs in sorted(hosts.items())},
        "lost": len(lost),
        "lost_ids": lost[:5],
        **dups,
        "lease_lost_by_host": lost_by_host,
        "lease_lost_partitioned_by_phase": {k[0]: v for k, v in phases.items()},
        "late_acks_refused": saw_refusal,
        "first_takeover_after_cut_s": round(takeovers[0] - cut_at, 1) if takeovers else None,
        "drained": drained,
        "drain_seconds": round(drain_s, 1),
        "stop_status": stops,
        "checker": checks,
        "checker_ok": report.ok,
        "checker_failures": [f"{c.name}: {'; '.join(c.details[:2])}" for c in report.violations],
    }
