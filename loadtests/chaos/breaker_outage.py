"""The breaker-outage scenario: a `--procs 2` farm (`breakerapp`) under steady load, one queue's
downstream down for a while behind a breaker, another queue of the same farm held to a
farm-wide rate the whole time.

    ok     steady load, succeeds
    down   steady load; its downstream (a flag file the handler looks at) is taken down for
           OUTAGE seconds; `Breaker(failures=5, probe_every=2)`, three attempts a row
    rated  published faster than its limit of RATE/s (and a backlog to start with), so that
           it has a backlog from the first second to the last of the load

Checked, beside the delivery checker's invariants (every message delivered at least once, as
its fate says): the breaker opened once and closed once, after the recovery (log events and
the gauge); /healthz said 200 throughout the outage with the breaker named under `degraded`;
no row of `down` was dead-lettered; the attempts spent during the outage were at most the
breaker's failures plus one per probe (probes counted from the `breaker_probe` events), and
no more probes than one per interval; `rated`'s handlers started RATE/s within 5 % while it
had a backlog (read from the ledger, the handlers' own records); every row of `down`
published before the recovery was delivered within RECOVERED_WITHIN seconds of it.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import psycopg

from loadtests.common import expected, scenario, tables
from loadtests.common.waits import wait_until
from outbox_farm.admin import limit_queue
from outbox_farm.limits import parse_rate

from .checks import (
    Context,
    Finding,
    HealthSampler,
    Result,
    Sample,
    events_named,
    healthy,
    survived,
)
from .farms import FarmRun, farm
from .load import PRODUCER, Load

NAME = "breaker-outage"
APP = "loadtests.chaos.breakerapp:farm"
FAILURES = 5  # the breaker's failures in a row (the app's BREAKERAPP_FAILURES)
PROBE_EVERY = 2.0  # seconds between its probes (BREAKERAPP_PROBE_EVERY)
RATE = 50  # rated's farm-wide limit, rows per second
OVER = 1.25  # rated is published this much faster than its limit
HEAD_START = 5.0  # seconds of rated's rate published before the farm starts
STEADY = {"ok": 100.0, "down": 20.0}  # rows per second
EXPECT: dict[str, tuple[str, int | None]] = {
    "down": (scenario.SUCCESS, None),
    "rated": (scenario.SUCCESS, None),
}
TOLERANCE = 0.05  # rated's handled rate against its limit
RECOVERED_WITHIN = 15.0  # seconds from the recovery until the outage's rows are delivered
DRAIN_WAIT = 120.0  # seconds rated's backlog may take to drain at its rate after the load
SEEN_WITHIN = 30.0  # seconds the breaker may take to show (gauge, /healthz) once down
GAUGE = "outbox_farm_breaker_open"
NOTE = "queue down breaker open since"

OUTAGE_ROWS = tables.query(
    "SELECT count(*), coalesce(sum(attempts_count), 0), coalesce(max(id), 0) "
    "FROM {outbox} WHERE queue = 'down'"
)
LEFT_OF_OUTAGE = tables.query("SELECT count(*) FROM {outbox} WHERE queue = 'down' AND id <= %s")
DEAD = tables.query("SELECT count(*) FROM {dlq} WHERE queue = 'down'")
RATED_BACKLOG = tables.query(
    "SELECT now(), count(*) FROM {outbox} WHERE queue = 'rated' AND acquired_token IS NULL"
)
RATED_LEFT = tables.query("SELECT count(*) FROM {outbox} WHERE queue = 'rated'")
RATED_RUNS = (
    "SELECT count(*) FROM loadtest_ledger "
    "WHERE queue = 'rated' AND outcome = 'success' AND at >= %s AND at <= %s"
)


def scenario_run(ctx: Context) -> Result:
    """The scenario (see the module)."""
    from .scenarios import database, settle  # scenarios.py registers this module: no cycle

    result = Result(NAME)
    flag = ctx.work / "breaker-outage-down"
    flag.unlink(missing_ok=True)
    outage = ctx.seconds(30)
    with database(ctx.admin) as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            limit_queue(conn, tables.NAMES, "rated", rate=parse_rate(f"{RATE}/s"))
            with conn.transaction():
                expected.publish(
                    conn, PRODUCER, "rated", count=int(RATE * HEAD_START), expect=scenario.SUCCESS
                )
        env = {
            "BREAKERAPP_DOWN": str(flag),
            "BREAKERAPP_FAILURES": str(FAILURES),
            "BREAKERAPP_PROBE_EVERY": str(PROBE_EVERY),
        }
        with farm(dsn, 2, ctx.work, app=APP, name=NAME, extra_env=env) as run:
            backlog = BacklogSampler(dsn).start()
            loads = [
                Load(dsn, sum(STEADY.values()), STEADY, expect=EXPECT).start(),
                Load(dsn, RATE * OVER, {"rated": 1.0}, threads=1, expect=EXPECT).start(),
            ]
            load_began = time.monotonic()
            time.sleep(ctx.seconds(10))  # steady load before the outage

            flag.touch()
            down_at = time.monotonic()
            seen = wait_until(lambda: _open(run) and _degraded(run), SEEN_WITHIN)
            result.findings.append(
                Finding(
                    "breaker-shows-open",
                    seen,
                    f"gauge {run.scrape().total(GAUGE, queue='down'):g}; /healthz {run.health()}",
                )
            )
            health = HealthSampler(run).start()
            time.sleep(max(outage - (time.monotonic() - down_at), 1.0))
            samples = health.stop()
            with psycopg.connect(dsn, autocommit=True) as conn:
                rows, attempts, last_id = _one(conn, OUTAGE_ROWS)
                dead = _one(conn, DEAD)[0]
            probes = len(events_named(run, "breaker_probe"))
            closed_early = len(_changes(run, "breaker_closed"))
            failed_runs = _failed_runs(dsn)
            flag.unlink()
            recovered = time.monotonic()
            open_for = recovered - down_at

            def recovered_fully() -> bool:
                with psycopg.connect(dsn, autocommit=True) as conn:
                    left = _one(conn, LEFT_OF_OUTAGE, [last_id])[0]
                return left == 0 and not _open(run) and bool(_changes(run, "breaker_closed"))

            back = wait_until(recovered_fully, RECOVERED_WITHIN * 4)
            took = time.monotonic() - recovered
            result.recovery = took
            clear = wait_until(lambda: not _degraded(run) and healthy(run), SEEN_WITHIN)
            cleared = Finding("healthz-clear-after-recovery", clear, str(run.health()))
            time.sleep(ctx.seconds(10))  # steady load after the recovery
            for load in loads:
                load.stop()
            loaded = time.monotonic() - load_began
            windows = backlog.stop()
            with psycopg.connect(dsn, autocommit=True) as conn:
                rated_left = wait_until(lambda: _one(conn, RATED_LEFT)[0] == 0, DRAIN_WAIT)
                # The drain's wait needs counters that stand still, and an idle limited
                # queue's empty claims keep counting outbox_farm_limited_claims_total: the
                # limit goes once its backlog is delivered under it.
                limit_queue(conn, tables.NAMES, "rated", rate=None)
            result.findings.append(
                Finding("rated-drained-under-its-limit", rated_left, f"within {DRAIN_WAIT:g}s")
            )
            settle(result, dsn, [run])
            survived(result, run)
            seen_rate, span = _rated_rate(dsn, windows)
            scrape = run.scrape()
            claims = scrape.total("outbox_farm_fetch_seconds_count", queue="rated")
            claim_ms = 1000 * scrape.total("outbox_farm_fetch_seconds_sum", queue="rated")
            claim_ms /= max(claims, 1)

        opened = len(_changes(run, "breaker_opened"))
        closed = len(_changes(run, "breaker_closed"))
        seen_closed = len(events_named(run, "breaker_releases"))
        result.findings += [
            Finding(
                "breaker-opened-and-closed-once",
                opened == 1 and closed == 1 and closed_early == 0,
                f"breaker_opened {opened}, breaker_closed {closed} ({closed_early} of them "
                f"before the recovery; {seen_closed} other process(es) logged it closed)",
            ),
            _healthz_degraded(samples),
            cleared,
            Finding("no-dead-letters-of-the-outage", dead == 0, f"{dead} row(s) of down in DLQ"),
            Finding(
                "attempts-within-failures-and-probes",
                attempts <= FAILURES + probes,
                f"{attempts} attempts spent on {rows} waiting rows; {FAILURES} "
                f"failures + {probes} probes allowed",
            ),
            Finding(
                "one-probe-per-interval",
                0 < probes <= open_for / PROBE_EVERY + 2,
                f"{probes} probes in {open_for:.0f}s, one per {PROBE_EVERY:g}s",
            ),
            Finding(
                "outage-backlog-delivered-after-recovery",
                back and took <= RECOVERED_WITHIN,
                f"rows of down up to id {last_id} delivered {took:.1f}s after the recovery "
                f"(bound {RECOVERED_WITHIN:g}s)"
                if back
                else f"rows of down up to id {last_id} not all delivered, or the breaker not "
                f"closed, {took:.0f}s after it",
            ),
            Finding(
                "limited-rate-held",
                span >= loaded / 2 and abs(seen_rate / RATE - 1) <= TOLERANCE,
                f"rated ran {seen_rate:.2f}/s over {span:.0f}s of backlog in {loaded:.0f}s of "
                f"load, limit {RATE}/s "
                f"({(seen_rate / RATE - 1) if span else -1:+.1%}); its claims took "
                f"{claim_ms:.1f} ms on average (time the bucket, a tenth of a second deep, "
                "spends full is lost)",
            ),
        ]
        result.note = (
            f"open {open_for:.0f}s: {attempts} attempts spent "
            f"(≤ {FAILURES} + {probes} probes), {failed_runs} runs failed; "
            f"rated {seen_rate:.1f}/s of {RATE}/s (claims {claim_ms:.0f} ms); outage rows "
            f"delivered {took:.1f}s after"
        )
    return result


def _one(conn: psycopg.Connection[Any], query: str, params: Any = None) -> tuple[Any, ...]:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return tuple(row)


def _changes(run: FarmRun, event: str) -> list[dict[str, Any]]:
    """The breaker's `event`s as logged by the process that opened or closed it (the others
    log `breaker_holds` and `breaker_releases` when they learn of it)."""
    return [e for e in events_named(run, event) if e.get("logger") == "outbox_farm.breaker"]


def _open(run: FarmRun) -> bool:
    return run.scrape().total(GAUGE, queue="down") >= 1


def _degraded(run: FarmRun) -> bool:
    health = run.health()
    return health is not None and health[0] == 200 and NOTE in str(health[1].get("degraded"))


def _failed_runs(dsn: str) -> int:
    """Runs of `down` that failed so far, from the ledger: those the breaker sent back with
    their attempts kept are among them, so they may outnumber the attempts spent."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return int(
            _one(conn, "SELECT count(*) FROM loadtest_ledger WHERE queue = 'down' "
                 "AND outcome = 'error'")[0]
        )  # fmt: skip


def _healthz_degraded(samples: list[Sample]) -> Finding:
    """Throughout the outage, once the breaker showed: 200, and the breaker named."""
    failing = [s for s in samples if s[1] != 200]
    silent = [s for s in samples if s[1] == 200 and NOTE not in s[2]]
    ok = bool(samples) and not failing and not silent
    detail = f"{len(samples)} answers: {len(failing)} not 200, {len(silent)} without the note"
    if failing or silent:
        detail += f"; e.g. {(failing or silent)[0][2][:120]}"
    return Finding("healthz-degraded-not-failing", ok, detail)


class BacklogSampler:
    """rated's waiting rows, counted every half second on the database's clock (the ledger's
    clock too); `stop` gives the spans in which every count was above 0."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.samples: list[tuple[Any, int]] = []
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._go, daemon=True, name="chaos-backlog")

    def start(self) -> BacklogSampler:
        self._thread.start()
        return self

    def stop(self) -> list[tuple[Any, Any]]:
        self._halt.set()
        self._thread.join(15)
        spans: list[tuple[Any, Any]] = []
        began = None
        for at, waiting in self.samples:
            if waiting > 0 and began is None:
                began = at
            elif waiting == 0 and began is not None:
                spans.append((began, at))
                began = None
        if began is not None and self.samples:
            spans.append((began, self.samples[-1][0]))
        return spans

    def _go(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True, application_name="chaos-check") as conn:
            while not self._halt.wait(0.5):
                at, waiting = _one(conn, RATED_BACKLOG)
                self.samples.append((at, int(waiting)))


def _rated_rate(dsn: str, spans: list[tuple[Any, Any]]) -> tuple[float, float]:
    """rated's handler starts per second over the longest span with a backlog, its first
    second left out (the bucket starts full); (rate, seconds of the window)."""
    if not spans:
        return 0.0, 0.0
    began, ended = max(spans, key=lambda s: s[1] - s[0])
    seconds = (ended - began).total_seconds() - 1.0
    if seconds <= 0:
        return 0.0, 0.0
    with psycopg.connect(dsn, autocommit=True) as conn:
        runs = _one(conn, RATED_RUNS, [began + timedelta(seconds=1), ended])[0]
    return int(runs) / seconds, seconds
