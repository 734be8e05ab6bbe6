"""The relay-restart scenarios, one per broker: a `--procs 2` farm relays queue `events` to a
private broker (`loadtests.common.restartable`: tansu, RabbitMQ, NATS JetStream or Redis) under
steady load, while the broker is SIGKILLed and started again twice: once left down until the
relay reports it (`relay_up` 0, /healthz 503), once at once (the next rows meet a broker that
forgot the producer). The relay's retry strategy (`loadtests.common.restartapp`) dead-letters a
row at its first failure but a missing topic, so a row that spent an attempt on the outage shows
in the DLQ.

Checked: no dead letter; after each restart, every row published since the kill arrives within
30 s of the restart (tansu and Redis keep nothing across a kill: rows delivered before it are
gone with the broker); the relay is reported down during the outage and up after; the outbox
drains; the farm's workers survive.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg

from loadtests.common import tables
from loadtests.common.harness import scratch_database
from loadtests.common.restartable import Broker, Load, broker, row_ids
from loadtests.common.waits import wait_until

from .checks import Context, Finding, Result, survived
from .farms import FarmRun, farm

WITHIN = 30.0  # seconds from the restart until every row arrived
WAIT = 120.0  # how long the checks wait, to tell how late a row was rather than only that it was


def scenario(kind: str) -> Callable[[Context], Result]:
    def run(ctx: Context) -> Result:
        return relay_restart(ctx, kind)

    run.__doc__ = f"relay-restart-{kind}: {__doc__.splitlines()[0]}"
    return run


def relay_restart(ctx: Context, kind: str) -> Result:
    result = Result(f"relay-restart-{kind}")
    took: list[float | None] = []
    with (
        broker(kind) as private,
        scratch_database(ctx.admin, tables.NAMES, prefix="outbox_farm_chaos_") as dsn,
        farm(
            dsn, 2, ctx.work, app="loadtests.common.restartapp:farm", name=result.scenario,
            extra_env=private.env(),
        ) as run,
    ):  # fmt: skip
        with Load(dsn) as load:
            time.sleep(ctx.seconds(5))  # steady load before the fault
            for outage in (True, False):
                private.kill()
                killed = len(load.ids)  # later rows cannot have reached the killed broker
                if outage:
                    down = wait_until(lambda: _down(run), WAIT)
                    result.findings.append(
                        Finding("reported-down", down, "relay_up 0 and /healthz 503")
                    )
                    time.sleep(ctx.seconds(5))  # rows pile up
                private.start()
                restarted = time.monotonic()
                private.prepare()  # a memory-only broker forgot the topic: made again
                time.sleep(ctx.seconds(5))
                missing = _arrival(private, set(load.ids[killed:]), restarted)
                took.append(missing if isinstance(missing, float) else None)
                result.lost += len(missing) if isinstance(missing, set) else 0
        result.published = len(load.ids)
        slowest = None if None in took else max(t for t in took if t is not None)
        result.recovery = slowest
        result.findings.append(
            Finding(
                "arrives-within-30s",
                slowest is not None and slowest <= WITHIN,
                "after each restart, every row published since the kill arrived "
                + ", ".join("never" if t is None else f"{t:.1f}s" for t in took)
                + " after it",
            )
        )
        _settled(result, dsn, run)
        unconfirmed = run.scrape().total("outbox_farm_relay_unconfirmed_total")
        result.note = f"2 restarts; {unconfirmed:g} publishes unconfirmed, held and re-sent"
    return result


def _down(run: FarmRun) -> bool:
    health = run.health()
    up = run.scrape().total("outbox_farm_relay_up")
    return up == 0 and health is not None and health[0] == 503


def _arrival(private: Broker, expected: set[int], since: float) -> float | set[int]:
    """Seconds from `since` until every row of `expected` is at the broker; the rows still
    missing if they did not all arrive within `WAIT`."""
    if wait_until(lambda: not expected - row_ids(private.arrived()), WAIT):
        return time.monotonic() - since
    return expected - row_ids(private.arrived())


def _settled(result: Result, dsn: str, run: FarmRun) -> None:
    def count(table: str) -> int:
        with psycopg.connect(dsn) as conn:
            row = conn.execute(tables.query(f"SELECT count(*) FROM {{{table}}}")).fetchone()
        return int(row[0]) if row else -1

    drained = wait_until(lambda: count("outbox") == 0, WAIT)
    left = count("outbox")
    result.findings.append(Finding("drains", drained, f"{left} rows left"))
    dead = count("dlq")
    result.handled = result.published - left - dead  # acked: confirmed by the broker
    result.findings.append(Finding("no-dead-letters", dead == 0, f"{dead} rows in the DLQ"))
    up = wait_until(lambda: run.scrape().total("outbox_farm_relay_up") == 1, WAIT)
    result.findings.append(Finding("reported-up", up, "relay_up 1 (the lowest of the processes)"))
    survived(result, run)
