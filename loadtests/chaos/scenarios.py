"""The scenarios: each runs a farm under steady load, does its fault, stops the load, waits
for the drain and ends with the delivery checker plus the invariants of its own.

Durations scale with `Context.scale` (1 for `make chaos`, less for the CI smoke run).
"""

from __future__ import annotations

import contextlib
import random
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import psycopg

from loadtests.common import checker, expected, restartable, scenario, tables
from loadtests.common.drain import wait_for_drain
from loadtests.common.harness import CLI, Metrics, scratch_database
from loadtests.common.ledger import create_schema
from loadtests.common.waits import wait_until

from . import breaker_outage, relay_restart
from .checks import (
    Context,
    Finding,
    HealthSampler,
    Result,
    events_named,
    healthy,
    healthy_throughout,
    healthz_answers_fast,
    kill_pid,
    measure_drain,
    oldest,
    sample_backlog,
    supervised,
    survived,
    unhealthy_with,
    watch_health,
)
from .farms import FarmRun, Server, farm, farm_backends, merged, terminate
from .load import PRODUCER, Load
from .outage import FakeClock, StoppableServer, TcpProxy, faketime_missing, wall_clock_offset

STEADY = {"ok": 70.0, "flaky": 15.0, "poison": 5.0, "reject": 5.0, "maxdel": 5.0}
DRAIN_TIMEOUT = 120.0
QUEUES_PER_APP = len(scenario.QUEUES)  # farmapp's queues: the connection formula's input
# poisonapp's queues -> (expected fate, handler runs allowed by their max_deliveries). kbint
# and hang have no max_deliveries: the farm bounds their runs only by "again only after the
# process of the previous run died", which `ran_once_unless_killed` checks.
POISON = {
    "exit": ("max_deliveries", 2),
    "kbint": ("retry_terminal", None),
    "hang": ("retry_terminal", None),
    "block": ("max_deliveries", 2),
    "ok": (scenario.SUCCESS, None),
}
ONCE_UNLESS_KILLED = ("kbint", "hang")
STALL = {"long": (scenario.SUCCESS, None), "stall": (scenario.SUCCESS, None)}  # stallapp's


@contextlib.contextmanager
def database(admin: str) -> Iterator[str]:
    with scratch_database(
        admin, tables.NAMES, prefix="outbox_farm_chaos_", prepare=create_schema
    ) as dsn:
        yield dsn


def settle(
    result: Result,
    dsn: str,
    farms: list[FarmRun],
    *,
    earlier: Metrics | None = None,
    killed: set[int] | None = None,
    allowed: frozenset[str] = frozenset(),
    fault_ended: float | None = None,
) -> None:
    """Wait for the drain, run the checker, and fill `result` from it. `earlier`: the
    counters of farms no longer running; `allowed`: checker invariants this fault breaks on
    purpose (the scenario checks what must hold instead)."""
    with psycopg.connect(dsn, autocommit=True, application_name="chaos-check") as conn:
        for run in farms:
            drain = wait_for_drain(conn, run.url + "/metrics", DRAIN_TIMEOUT)
            if not drain.drained:
                result.findings.append(
                    Finding("drains", False, f"{drain.outbox_rows} rows left after the load")
                )
        if fault_ended is not None:
            result.recovery = time.monotonic() - fault_ended
        scrape = merged(*(r.scrape() for r in farms), *([earlier] if earlier else []))
        dead = set(killed or ()).union(*(r.dead() for r in farms))
        report = checker.check(conn, scrape, killed=dead)
        counts = conn.execute(
            tables.query("""
            SELECT (SELECT count(*) FROM loadtest_expected),
                   (SELECT count(DISTINCT msg_id) FROM (
                        SELECT msg_id FROM loadtest_ledger WHERE outcome = 'success'
                        UNION SELECT convert_from(payload, 'UTF8')::jsonb ->> 'id'
                        FROM {dlq}) AS done),
                   (SELECT coalesce(sum(n - 1), 0) FROM (
                        SELECT count(*) AS n FROM loadtest_ledger WHERE outcome = 'success'
                        GROUP BY msg_id) AS d)
            """)
        ).fetchone()
    assert counts is not None
    result.published, result.handled, result.duplicates = (int(c) for c in counts)
    result.lost = result.published - result.handled
    for check in report.checks:
        if check.skipped:
            continue
        if check.name in allowed:
            continue
        detail = "; ".join(check.details[:2])
        result.findings.append(Finding(check.name, check.ok, detail))
        if check.name == "duplicates-within-lease-lost":
            result.explained = check.ok


def during(seconds: float, every: float, action: Callable[[], None]) -> None:
    """Call `action` every `every` s (jittered) for `seconds`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(random.uniform(0.5, 1.5) * every, max(end - time.monotonic(), 0)))
        if time.monotonic() < end:
            action()


# -- the scenarios ---------------------------------------------------------------------------


def worker_kill(ctx: Context) -> Result:
    """SIGKILL a worker 10 times at random moments; then SIGKILL the arbiter with its workers
    and start a new farm, as on a host that lost power and came back."""
    result = Result("worker-kill")
    with database(ctx.admin) as dsn:
        load = Load(dsn, 300, STEADY).start()
        with farm(dsn, 2, ctx.work, name="worker-kill-1") as first:
            kills = ctx.seconds(40) / 10
            for _ in range(10):
                time.sleep(random.uniform(0.3, 1.7) * kills)
                first.kill_worker()
            time.sleep(2)
            survived(result, first, restarts_allowed=True)  # replaced every killed worker
            earlier, dead = first.scrape(), first.dead()
            first.kill_all()
            dead |= first.killed
        began = time.monotonic()
        with farm(dsn, 2, ctx.work, name="worker-kill-2") as second:
            time.sleep(ctx.seconds(5))
            load.stop()
            settle(result, dsn, [second], earlier=earlier, killed=dead, fault_ended=began)
        result.note = f"{len(dead)} workers died"
    return result


def stall(ctx: Context) -> Result:
    """A worker stalls (its event loop blocked for 2.5 leases) while it holds rows, 3 times:
    the other worker takes those rows over, and the stalled worker's late ack must find them
    taken (the lease token guards every write). So a lease may be lost only by the worker
    that stalled; one reported by the other means a stale write removed its row under it."""
    result = Result("stall")
    app = "loadtests.chaos.stallapp:farm"
    with database(ctx.admin) as dsn, farm(dsn, 2, ctx.work, app=app, name="stall") as run:
        load = Load(dsn, 40, {"long": 1.0}, expect=STALL).start()
        for _ in range(3):
            time.sleep(max(ctx.seconds(10), 4.0))  # a run's length: every worker is busy
            with psycopg.connect(dsn) as conn:  # some reach the staller, some the other
                expected.publish(conn, PRODUCER, "stall", count=4, expect=scenario.SUCCESS)
        time.sleep(max(ctx.seconds(5), 8.0))  # the last stalls and their take-overs end
        ended = time.monotonic()
        load.stop()
        settle(result, dsn, [run], fault_ended=ended)
        survived(result, run)  # a stall shorter than the heartbeat timeout kills nothing
        events = run.events()
        stalled = {int(e.get("pid", 0)) for e in events if e.get("event") == "stalled"}
        lost = [e for e in events if e.get("event") == "lease_lost"]
        refused = sum(1 for e in lost if e.get("phase") != "heartbeat" and e.get("pid") in stalled)
        strangers = sorted({int(e.get("pid", 0)) for e in lost} - stalled)
        result.findings.append(
            Finding(
                "leases-lost-only-by-stalled-workers",
                not strangers,
                f"lost leases reported by pids that never stalled: {strangers}; stalled: "
                f"{sorted(stalled)}"
                if strangers
                else "",
            )
        )
        result.findings.append(
            Finding(
                "stale-writes-tried",
                refused > 0,
                f"{len(stalled)} stalled worker(s), {refused} stale write(s) refused"
                if refused
                else "no stalled worker wrote late: the scenario proved nothing",
            )
        )
        phases = ", ".join(f"{n} {p}" for p, n in Counter(e.get("phase") for e in lost).items())
        result.note = f"leases lost: {phases or 0}; {refused} stale writes refused"
    return result


def pg_terminate(ctx: Context) -> Result:
    """`pg_terminate_backend` on every farm connection, 5 times."""
    result = Result("pg-terminate")
    with database(ctx.admin) as dsn, farm(dsn, 2, ctx.work, name="pg-terminate") as run:
        dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
        load = Load(dsn, 300, STEADY).start()
        terminated = []
        for _ in range(5):
            time.sleep(ctx.seconds(30) / 5)
            terminated.append(terminate(ctx.admin, farm_backends(ctx.admin, str(dbname))))
        ended = time.monotonic()
        time.sleep(ctx.seconds(5))
        load.stop()
        settle(result, dsn, [run], fault_ended=ended)
        survived(result, run)
        result.note = f"terminated {sum(terminated)} connections"
    return result


def pg_restart(ctx: Context) -> Result:
    """Restart the server (`-m fast`, then `-m immediate`) mid-run: a server of the suite's
    own, never the shared one."""
    result = Result("pg-restart")
    server = Server()
    try:
        with database(server.dsn) as dsn, farm(dsn, 2, ctx.work, name="pg-restart") as run:
            load = Load(dsn, 300, STEADY).start()
            took = []
            for mode in ("fast", "immediate"):
                time.sleep(ctx.seconds(15))
                took.append(server.restart(mode))
            ended = time.monotonic()
            time.sleep(ctx.seconds(10))
            load.stop()
            # The flaky handler writes its "failed" ledger row before raising; a restart can
            # fail that write (the run still failed, counted by the farm, but unrecorded).
            allowed = frozenset({"flaky-failed-n-times"})
            settle(result, dsn, [run], allowed=allowed, fault_ended=ended)
            survived(result, run)
            result.note = "restarts took " + ", ".join(f"{t:.1f}s" for t in took)
    finally:
        server.close()
    return result


def dlq_drop(ctx: Context) -> Result:
    """Drop the DLQ table while terminal failures flow, then repair it with `migrate`."""
    result = Result("dlq-drop")
    weights = {"ok": 60.0, "poison": 20.0, "reject": 20.0}
    with database(ctx.admin) as dsn, farm(dsn, 2, ctx.work, name="dlq-drop") as run:
        load = Load(dsn, 200, weights).start()
        time.sleep(ctx.seconds(8))
        with psycopg.connect(dsn) as conn:
            # What the DROP destroys is the operator's doing, not the farm's: kept aside and
            # put back after the repair, as from a backup, so the checker sees every row. The
            # lock comes first: a DLQ move committed between the copy's snapshot and the DROP
            # would otherwise be destroyed without a copy.
            conn.execute(tables.query("LOCK TABLE {dlq} IN ACCESS EXCLUSIVE MODE"))
            conn.execute(tables.query("CREATE TABLE chaos_dlq_dropped AS SELECT * FROM {dlq}"))
            conn.execute(tables.query("DROP TABLE {dlq}"))
        said = wait_until(lambda: unhealthy_with(run, tables.DLQ), 20)
        result.findings.append(
            Finding("healthz-names-the-missing-dlq", said, "" if said else str(run.health()))
        )
        time.sleep(ctx.seconds(8))
        subprocess.run([str(CLI), "migrate", "--dsn", dsn], check=True, capture_output=True)
        ended = time.monotonic()
        with psycopg.connect(dsn) as conn:
            conn.execute(
                tables.query(
                    "INSERT INTO {dlq} (original_id, queue, payload, headers, deliveries_count, "
                    "created_at, failed_at, failure_reason, last_exception, timer_id) "
                    "SELECT original_id, queue, payload, headers, deliveries_count, created_at, "
                    "failed_at, failure_reason, last_exception, timer_id FROM chaos_dlq_dropped"
                )
            )
        back = wait_until(lambda: (run.health() or (0, {}))[0] == 200, 30)
        result.findings.append(Finding("healthz-recovers", back, str(run.health())))
        time.sleep(ctx.seconds(5))
        load.stop()
        settle(result, dsn, [run], allowed=frozenset({"no-write-failures"}), fault_ended=ended)
        failed = run.scrape().total("outbox_farm_write_failed_total", kind="terminal")
        result.findings.append(
            Finding("failed-dlq-moves-counted", failed > 0, f"write_failed_total {failed:g}")
        )
        result.note = f"{failed:g} DLQ moves failed while it was gone"
    return result


def overload(ctx: Context) -> Result:
    """1.5x the measured drain rate, then normal load: the backlog peaks, drains, and the
    lag comes back under a second; nothing lost."""
    result = Result("overload")
    with database(ctx.admin) as dsn, farm(dsn, 2, ctx.work, name="overload") as run:
        rate = measure_drain(dsn, run, int(8000 * ctx.scale) or 2000)
        peak, lag = [0], [0.0]
        stop = threading.Event()
        sampler = threading.Thread(target=sample_backlog, args=(dsn, peak, lag, stop))
        sampler.start()
        heavy = Load(dsn, 1.5 * rate, {"ok": 100.0}, threads=4).start()
        time.sleep(ctx.seconds(90))
        heavy_sent = heavy.stop()
        ended = time.monotonic()
        light = Load(dsn, 0.3 * rate, {"ok": 100.0}).start()
        calm = wait_until(lambda: lag[0] < 1.0, ctx.seconds(120))
        recovery = time.monotonic() - ended
        time.sleep(ctx.seconds(10))
        light.stop()
        stop.set()
        sampler.join()
        achieved = heavy_sent / ctx.seconds(90)
        result.findings.append(
            Finding("lag-back-under-1s", calm, f"lag {lag[0]:.1f}s after {recovery:.0f}s")
        )
        result.findings.append(
            Finding(
                "overloaded",
                peak[0] > rate,
                f"published {achieved:.0f}/s vs drain {rate:.0f}/s; backlog peak {peak[0]}",
            )
        )
        settle(result, dsn, [run])
        result.recovery = recovery
        result.note = f"drain {rate:.0f}/s, load {achieved:.0f}/s, backlog peak {peak[0]:,}"
    return result


def xmin_held(ctx: Context) -> Result:
    """A transaction holds back the xmin horizon for minutes under steady load: the farm says
    so (gauge and WARNING naming the backend) and recovers after the release."""
    result = Result("xmin")
    hold = max(ctx.seconds(120), 70.0)  # the WARNING comes once the horizon is a minute old
    with database(ctx.admin) as dsn, farm(dsn, 2, ctx.work, name="xmin") as run:
        load = Load(dsn, 300, {"ok": 100.0}).start()
        holder = psycopg.connect(dsn, application_name="chaos-xmin")
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM loadtest_expected")
        pid = holder.info.backend_pid
        age = [0.0]

        def watch() -> None:
            age[0] = max(age[0], run.scrape().total("outbox_farm_xmin_horizon_age_seconds"))

        during(hold, 5, watch)
        holder.rollback()
        holder.close()
        ended = time.monotonic()
        named = any(
            e.get("event") == "xmin_held" and f"pid {pid}" in str(e.get("message"))
            for e in run.events()
        )
        horizon = "outbox_farm_xmin_horizon_age_seconds"
        gone = wait_until(lambda: run.scrape().total(horizon) < 5, 60)
        load.stop()
        result.findings.append(
            Finding(
                "gauge-shows-the-held-horizon",
                age[0] > hold / 2,
                f"max {age[0]:.0f}s over a {hold:.0f}s hold",
            )
        )
        result.findings.append(Finding("warning-names-the-backend", named, f"pid {pid}"))
        result.findings.append(Finding("gauge-recovers", gone))
        settle(result, dsn, [run], fault_ended=ended)
        result.note = f"held {hold:.0f}s; gauge peaked at {age[0]:.0f}s"
    return result


def poison(ctx: Context) -> Result:
    """Handlers that exit the process, raise KeyboardInterrupt, hang, or block the loop: the
    farm keeps running and each message ends in the DLQ with the right reason."""
    result = Result("poison")
    expect = POISON
    with database(ctx.admin) as dsn:
        options = ["--heartbeat-timeout", "3"]
        app = "loadtests.chaos.poisonapp:farm"
        with farm(dsn, 2, ctx.work, app=app, options=options, name="poison") as run:
            load = Load(dsn, 100, {"ok": 100.0}, expect=expect).start()
            bad = Load(dsn, 2, {q: 1.0 for q in expect if q != "ok"}, threads=1, expect=expect)
            bad.start()
            time.sleep(ctx.seconds(10))
            bad.stop()
            time.sleep(ctx.seconds(20))
            load.stop()
            ended = time.monotonic()
            settle(result, dsn, [run], fault_ended=ended)
            survived(result, run, restarts_allowed=True)
            ran_once_unless_killed(result, dsn, run.dead())
            result.note = f"{len(run.dead())} workers died and were replaced"
    return result


def ran_once_unless_killed(result: Result, dsn: str, dead: set[int]) -> None:
    """A message of a queue without max_deliveries runs once, and again only when the process
    of an earlier run died (a poison message elsewhere in that worker took it down)."""
    with psycopg.connect(dsn, autocommit=True, application_name="chaos-check") as conn:
        over = conn.execute(
            "SELECT msg_id, queue, array_agg(pid) FROM loadtest_ledger WHERE queue = ANY(%s) "
            "GROUP BY msg_id, queue HAVING count(*) FILTER (WHERE pid <> ALL(%s)) > 1 "
            "ORDER BY msg_id LIMIT 5",
            [list(ONCE_UNLESS_KILLED), sorted(dead)],
        ).fetchall()
    result.findings.append(
        Finding(
            "ran-once-unless-killed",
            not over,
            "; ".join(f"{m} ({q}) ran in pids {p}, none killed" for m, q, p in over),
        )
    )


def two_farms(ctx: Context) -> Result:
    """Two independent farms (as on two hosts), --procs 2 each, on one database."""
    return scale_out(ctx, "two-farms", farms=2, procs=2)


def procs_8(ctx: Context) -> Result:
    """One farm with --procs 8 on this 2-core machine."""
    return scale_out(ctx, "procs-8", farms=1, procs=8)


def scale_out(ctx: Context, name: str, *, farms: int, procs: int) -> Result:
    result = Result(name)
    with database(ctx.admin) as dsn, contextlib.ExitStack() as stack:
        runs = [
            # The test app's ledger pool is not the farm's: kept small, so that 8 workers fit
            # a default max_connections of 100 beside the farm's own connections.
            stack.enter_context(farm(dsn, procs, ctx.work, name=f"{name}-{i}", ledger_pool=1))
            for i in range(farms)
        ]
        dbname = str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])
        load = Load(dsn, 600, STEADY, threads=3).start()
        began, most = time.monotonic(), [0]

        def count() -> None:
            most[0] = max(most[0], len(farm_backends(ctx.admin, dbname)))

        during(ctx.seconds(40), 1, count)
        load.stop()
        settle(result, dsn, runs)
        elapsed = time.monotonic() - began
        limit = farms * (procs * (QUEUES_PER_APP + 2 + 1) + 1)
        result.findings.append(
            Finding("connections-within-formula", most[0] <= limit, f"{most[0]} of {limit}")
        )
        for run in runs:
            survived(result, run)
        result.note = f"{result.handled / elapsed:.0f} msg/s handled; {most[0]} connections"
    return result


def clock_step(ctx: Context) -> Result:
    """The wall clock steps +1 h, then back 2 h (to -1 h), under load (libfaketime reading a
    file rewritten while the farm runs; CLOCK_MONOTONIC untouched, as in an NTP step or a VM
    resume); 5 workers are SIGKILLed after the backward step. No worker is killed for the
    forward step, the kills are booked as crashes (never boot failures), the farm does not
    halt, /healthz says 200 between kills, nothing is lost."""
    result = Result("clock-step")
    if missing := faketime_missing():
        result.findings.append(Finding("ran-to-the-end", False, f"cannot step a clock: {missing}"))
        return result
    clock = FakeClock(ctx.work / "clock-step-clock")
    options = ["--heartbeat-timeout", "5"]
    with (
        database(ctx.admin) as dsn,
        farm(dsn, 2, ctx.work, name="clock-step", options=options, extra_env=clock.env()) as run,
    ):
        load = Load(dsn, 300, STEADY).start()
        time.sleep(ctx.seconds(8))
        before = set(run.workers())
        clock.set("+1h")
        stepped = wall_clock_offset(clock.env())
        forward = watch_health(run, ctx.seconds(12))
        replaced = before - set(run.workers())
        result.findings.append(
            Finding("clock-stepped", abs(stepped - 3600) < 60, f"offset {stepped:.0f}s")
        )
        result.findings.append(
            Finding(
                "forward-step-kills-no-worker",
                not replaced and not events_named(run, "worker_stuck"),
                f"workers {sorted(replaced)} replaced after +1h" if replaced else "",
            )
        )
        result.findings.append(healthy_throughout("healthz-200-after-forward-step", forward))
        clock.set("-1h")
        kills = 0
        for _ in range(5):
            time.sleep(random.uniform(1.0, 2.0))
            if run.proc.poll() is None and oldest(run) is not None:
                kill_pid(run, oldest(run))
                kills += 1
        ended = time.monotonic()
        back = run.proc.poll() is None and wait_until(lambda: healthy(run), 30)
        result.findings.append(Finding("healthz-200-after-the-kills", back, str(run.health())))
        if run.proc.poll() is None:
            time.sleep(ctx.seconds(5))
        result.published = load.stop()
        supervised(result, run, crashes=kills)
        if run.proc.poll() is None:
            settle(result, dsn, [run], killed=run.killed, fault_ended=ended)
        result.note = f"+1h: {len(replaced)} workers replaced; -2h then {kills} kills"
    return result


def restart_during_crashes(ctx: Context) -> Result:
    """The database (a server of the suite's own) stops (fast shutdown) under load, every
    worker is SIGKILLed three times while it is down, and it starts again after 12 s: the
    farm waits the outage out (no boot failure, no halt), /healthz answers within
    milliseconds throughout, and everything is delivered after."""
    result = Result("restart-during-crashes")
    server = StoppableServer()
    try:
        with database(server.dsn) as dsn, farm(dsn, 2, ctx.work, name="restart-crashes") as run:
            load = Load(dsn, 300, STEADY).start()
            time.sleep(ctx.seconds(10))
            server.stop("fast")
            down = time.monotonic()
            sampler = HealthSampler(run).start()
            kills = 0
            for _ in range(3):
                time.sleep(random.uniform(1.5, 3.0))
                for pid in run.workers():
                    kill_pid(run, pid)
                    kills += 1
            while time.monotonic() - down < max(ctx.seconds(12), 10.0) and run.proc.poll() is None:
                time.sleep(0.2)
            samples = sampler.stop()
            server.start()
            ended = time.monotonic()
            result.findings.append(healthz_answers_fast("healthz-answers-during-outage", samples))
            back = run.proc.poll() is None and wait_until(lambda: healthy(run), 60)
            result.findings.append(Finding("healthz-200-after-restart", back, str(run.health())))
            if run.proc.poll() is None:
                time.sleep(ctx.seconds(5))
            result.published = load.stop()
            supervised(result, run)
            if run.proc.poll() is None:
                # As in pg-restart: the flaky handler's "failed" ledger write can be lost.
                allowed = frozenset({"flaky-failed-n-times"})
                settle(result, dsn, [run], killed=run.killed, allowed=allowed, fault_ended=ended)
            said = any("database unreachable" in s[2] for s in samples if s[1] == 503)
            result.note = (
                f"down {ended - down:.0f}s, {kills} workers killed meanwhile; "
                f"/healthz worst {max((s[3] for s in samples), default=0) * 1000:.0f} ms"
                + (", 503 'database unreachable'" if said else "")
            )
    finally:
        server.close()
    return result


def relay_kafka(ctx: Context) -> Result:
    """A `--procs 2` farm relays to Kafka (tansu) through a proxy that drops every packet for
    10 s, twice, under load, while a consumer records what arrives: nothing is lost, a record
    arrives twice only against an unconfirmed publish, no row is acked without its delivery
    report, unroutable rows (a topic that does not exist) end in the DLQ, the farm stays up."""
    import argparse

    from loadtests.common.farmproc import RELAY_APP
    from loadtests.common.harness import free_port
    from loadtests.common.kafkabroker import tansu
    from loadtests.common.relaymode import RELAY_WEIGHTS, relay_consumer

    result = Result("relay-kafka")
    listen = free_port()
    with (
        TcpProxy(("127.0.0.1", listen)) as proxy,
        tansu(listen, proxy.port),
        database(ctx.admin) as dsn,
    ):
        args = argparse.Namespace(relay="kafka", kafka=f"127.0.0.1:{proxy.port}", amqp="")
        with relay_consumer(args, dsn, ctx.work) as consumer, farm(
            dsn, 2, ctx.work, app=RELAY_APP, name="relay-kafka",
            extra_env=consumer.env,
        ) as run:  # fmt: skip
            weights = {q: w for q, w in scenario.parse_weights(RELAY_WEIGHTS).items() if w}
            load = Load(dsn, 300, weights).start()
            time.sleep(ctx.seconds(8))
            for _ in range(2):
                proxy.blackhole()
                time.sleep(ctx.seconds(10))
                proxy.restore()
                time.sleep(ctx.seconds(5))
            ended = time.monotonic()
            result.published = load.stop()
            with psycopg.connect(dsn, autocommit=True) as conn:
                drained = wait_for_drain(conn, run.url + "/metrics", DRAIN_TIMEOUT).drained
            consumer.stop()  # after the drain: it has recorded all that arrived
            result.findings.append(
                Finding(
                    "consumer-finished",
                    consumer.summary is not None,
                    str(consumer.summary or "the consumer did not finish: see consumer.log"),
                )
            )
            survived(result, run)
            if drained:
                settle(result, dsn, [run], fault_ended=ended)
            else:
                result.findings.append(Finding("drains", False, "rows left after the load"))
            unconfirmed = run.scrape().total("outbox_farm_relay_unconfirmed_total")
            result.note = (
                f"2 x {ctx.seconds(10):.0f}s without a packet; {unconfirmed:g} publishes "
                f"unconfirmed, re-sent; {proxy.accepted} connections through the proxy"
            )
    return result


SCENARIOS: dict[str, Callable[[Context], Result]] = {
    "worker-kill": worker_kill,
    "stall": stall,
    "pg-terminate": pg_terminate,
    "pg-restart": pg_restart,
    "dlq-drop": dlq_drop,
    "overload": overload,
    "xmin": xmin_held,
    "poison": poison,
    "two-farms": two_farms,
    "procs-8": procs_8,
    "clock-step": clock_step,
    "restart-during-crashes": restart_during_crashes,
    "relay-kafka": relay_kafka,
    **{f"relay-restart-{kind}": relay_restart.scenario(kind) for kind in restartable.KINDS},
    breaker_outage.NAME: breaker_outage.scenario_run,
}
