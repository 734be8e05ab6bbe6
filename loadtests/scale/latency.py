"""Latency: 20 ms ± 5 ms between the farm hosts and the database.

With `sch_netem` in the kernel, `tc netem` on each farm host's link; without it, the delaying
proxy of `delay.py` in the database host's namespace, in front of its Postgres (the farms
connect to the proxy's port, the producer straight to the server). Either way each round trip
of a farm to the database takes 20 ± 5 ms longer; which one was used is in the output.

Per configuration, with the farms on all three hosts: the lag (commit on the producer host ->
handler start on a farm host, both on the one kernel clock) at a steady moderate rate, then
the throughput (messages handled per second over a fixed window, from a backlog published in
one transaction and due at one instant). Configurations: no added delay (through the proxy
when it is used, so that its own cost is in the baseline), the delay with the defaults, the
delay with more rows claimed per round trip (`prefetch`) and more runs at once (`concurrency`).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg

from loadtests.common import tables
from loadtests.common.waits import wait_until

from .bed import (
    Bed,
    database,
    farms,
    lags,
    outbox_rows,
    percentile,
    read_commits,
    read_journals,
    say,
    timed_drain,
    via,
)
from .dbserver import PORT
from .hosts import clear_netem, delay_proxy, finish, netem, netem_available, produce, producer

PROXY_PORT = 6432
DELAY, JITTER = 0.020, 0.005


@dataclass(frozen=True)
class Config:
    name: str
    delay: float
    concurrency: int | None = None
    prefetch: int | None = None


CONFIGS = (
    Config("no added delay, defaults", 0.0),
    Config("20±5 ms, defaults", DELAY),
    Config("20±5 ms, prefetch 512", DELAY, prefetch=512),
    Config("20±5 ms, concurrency 128, prefetch 1024", DELAY, concurrency=128, prefetch=1024),
)


@dataclass(frozen=True)
class Plan:
    procs: int = 2
    rate: float = 200.0  # msg/s for the lag
    lag_seconds: float = 12.0
    backlog: int = 100_000
    window: float = 20.0  # seconds the throughput is counted over at most


@contextlib.contextmanager
def delayed(bed: Bed, dsn: str, config: Config, use_netem: bool) -> Iterator[str]:
    """The DSN the farms use for `config`. With netem: half the delay (and jitter) on each
    end of every farm host's link, so each round trip to the database grows by the whole of
    it, both ways, as through the proxy; else the delaying proxy's port."""
    if use_netem:
        ends = [
            (end, dev)
            for h in bed.farm_hosts(3)
            for end, dev in ((h.exec([]), "eth0"), ([], h.link))
        ]
        try:
            for prefix, device in ends:
                if config.delay:
                    netem(prefix, device, config.delay * 500, JITTER * 500)
            yield dsn
        finally:
            for prefix, device in ends:
                clear_netem(prefix, device)
        return
    log = bed.work / "proxy.log"
    target = f"127.0.0.1:{PORT}"
    with delay_proxy(bed.db, PROXY_PORT, target, config.delay, JITTER if config.delay else 0, log):
        yield via(dsn, PROXY_PORT)


def round_trip_ms(dsn: str, samples: int = 20) -> float:
    """The median time of `SELECT 1` on `dsn`, from here: the delay the farms see, checked
    (through the proxy, the harness goes the farms' way; with netem, it does not)."""
    times = []
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        for _ in range(samples):
            began = time.perf_counter()
            conn.execute("SELECT 1")
            times.append(time.perf_counter() - began)
    return round(statistics.median(times) * 1000, 1)


def throughput(
    bed: Bed, dsn: str, plan: Plan, conn: psycopg.Connection[Any], tag: str
) -> dict[str, float]:
    """A backlog of `plan.backlog` rows due at one instant: messages handled per second from
    the first row claimed to the table empty, or to the end of the window if sooner."""
    due = time.time() + 2.0 + plan.backlog / 10_000
    commits = bed.work / f"backlog-{tag}.tsv"
    args = ("--backlog", str(plan.backlog), "--due", str(due))
    produce(bed.producer, dsn, commits, *args, timeout=180)
    seconds, handled = timed_drain(conn, plan.backlog, due, plan.window)
    return {"msg_per_s": handled / seconds if seconds else 0.0, "seconds": seconds}


def _empty(conn: psycopg.Connection[Any]) -> bool:
    return outbox_rows(conn) == 0


def run(bed: Bed, smoke: bool) -> dict[str, Any]:
    plan = Plan(lag_seconds=5, backlog=5_000, window=5) if smoke else Plan()
    missing = netem_available(bed.farm_hosts(1)[0])
    method = "tc netem" if missing is None else "delaying TCP proxy (no sch_netem: " + missing + ")"
    say(f"latency: delay by {method}")
    rows: list[dict[str, Any]] = []
    ok = True
    for index, config in enumerate(CONFIGS):
        # A database of its own per configuration (see curve.py: a second backlog in one
        # database measured the table's history, not the configuration).
        with (
            database(bed) as dsn,
            psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn,
        ):
            env = {"SCALE_JOURNAL": str(bed.work / f"latency-{index}")}
            (bed.work / f"latency-{index}").mkdir()
            if config.concurrency:
                env["SCALE_CONCURRENCY"] = str(config.concurrency)
            if config.prefetch:
                env["SCALE_PREFETCH"] = str(config.prefetch)
            with (
                delayed(bed, dsn, config, missing is None) as farm_dsn,
                farms(bed, farm_dsn, 3, plan.procs, env, name=f"latency-{index}") as runs,
            ):
                rtt = round_trip_ms(farm_dsn) if missing is not None else None
                commits = bed.work / f"latency-commits-{index}.tsv"
                with producer(
                    bed.producer,
                    dsn,
                    commits,
                    "--rate",
                    str(plan.rate),
                    "--seconds",
                    str(plan.lag_seconds),
                ) as prod:
                    finish(prod, timeout=plan.lag_seconds + 60)
                ok &= wait_until(lambda: _empty(conn), 60, every=0.5)
                tput = throughput(bed, dsn, plan, conn, str(index))
                ok &= wait_until(lambda: _empty(conn), 180, every=0.5)
                for run in runs:
                    run.stop()
                dlq = conn.execute(tables.query("SELECT count(*) FROM {dlq}")).fetchone()
            journal = read_journals(bed.work / f"latency-{index}")
            published = read_commits(commits) | read_commits(bed.work / f"backlog-{index}.tsv")
            unhandled = set(published) - {r.msg_id for r in journal}
            ok &= not unhandled
            measured = lags(read_commits(commits), journal)
            row = {
                "config": config.name,
                "select1_ms": rtt,
                "msg_per_s": round(tput["msg_per_s"]),
                "window_s": round(tput["seconds"], 1),
                "lag_p50_ms": round(percentile(measured, 50) * 1000, 1),
                "lag_p99_ms": round(percentile(measured, 99) * 1000, 1),
                "lag_samples": len(measured),
                "published": len(published),
                "unhandled": len(unhandled),
                "unhandled_ids": sorted(unhandled)[:5],
                "dlq_rows": int(dlq[0]) if dlq else -1,
            }
            say(f"latency: {row}")
            rows.append(row)
    return {
        "scenario": "latency",
        "ok": ok and all(r["lag_samples"] > 0 and r["msg_per_s"] > 0 for r in rows),
        "method": method,
        "clock": "one kernel clock: time.time() on the producer host and on a farm host are the "
        "same clock, so commit -> handler start is a plain subtraction",
        "hosts": 3,
        "procs": plan.procs,
        "lag_rate": plan.rate,
        "backlog": plan.backlog,
        "window_s": plan.window,
        "rows": rows,
    }
