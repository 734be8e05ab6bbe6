"""A broker that restarts does not wedge a relay: `outbox-farm start --procs N` relays to a
private broker (tansu, RabbitMQ, NATS JetStream, Redis) that is SIGKILLed and started again on
its port, once while the relay is idle (its next rows meet a broker that forgot the producer:
the issue's case), once under load. During the second outage the relay is reported down
(`relay_up` 0, /healthz 503); after each restart every row arrives within 30 s; none is
dead-lettered, though the relay's retry strategy (`loadtests.common.restartapp`) dead-letters a
row at its first failure but a missing topic (no attempt is spent on the outage, nor on a broker
that forgot the producer)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from loadtests.common.restartable import Broker, Load, broker, publish, row_ids
from tests.acceptance.test_farm import RunningFarm, farm_process, scalar
from tests.steps import poll, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.one_server]

ROOT = Path(__file__).resolve().parents[2]
FIRST = 200  # rows delivered before the kill
AFTER = 200  # rows published once the broker is back
WITHIN = 30.0  # seconds from the restart until every row arrived


def relay_up(farm: RunningFarm) -> float | None:
    return farm.metric("outbox_farm_relay_up")


def down(farm: RunningFarm) -> bool:
    health = farm.health()
    return relay_up(farm) == 0 and health is not None and health[0] == 503


def up(farm: RunningFarm) -> bool:
    health = farm.health()
    return relay_up(farm) == 1 and health is not None and health[0] == 200


@pytest.fixture
def private(request: pytest.FixtureRequest) -> Iterator[Broker]:
    kind = request.param
    try:
        with broker(kind) as started:
            yield started
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("private", "procs"),
    [("kafka", 1), ("kafka", 2), ("rabbitmq", 1), ("nats", 1), ("redis", 1)],
    indirect=["private"],
)
def test_a_broker_killed_and_restarted_loses_and_dead_letters_nothing(
    tmp_path: Path, dsn: str, conn: psycopg.Connection[Any], private: Broker, procs: int
) -> None:
    """Twice: the broker restarted while the relay is idle (the next rows meet a broker that
    forgot the producer), then killed under load and started once the relay reported itself
    down."""
    env = {**private.env(), "PYTHONPATH": str(ROOT)}
    first = set(publish(dsn, FIRST))
    with farm_process(
        tmp_path, dsn, procs=procs, app="loadtests.common.restartapp:farm", **env
    ) as farm:
        arrive(dsn, private, first, farm, within=120)
        wait_for(lambda: up(farm), "relay_up 1 and /healthz 200", 60, farm)

        private.restart()
        restarted = time.monotonic()
        private.prepare()  # a memory-only broker forgot the topic: made again
        with Load(dsn) as load:
            after = set(publish(dsn, AFTER))
        arrive(dsn, private, after | set(load.ids), farm, since=restarted)

        with Load(dsn) as load:
            private.kill()
            wait_for(lambda: down(farm), "relay_up 0 and /healthz 503", 60, farm)
            private.start()
            restarted = time.monotonic()
            private.prepare()
            after = set(publish(dsn, AFTER))
        assert load.ids  # rows were published while the broker was down
        arrive(dsn, private, after | set(load.ids), farm, since=restarted)

        wait_for(lambda: up(farm), "relay_up 1 and /healthz 200 again", 60, farm)
        dead = scalar(conn, "SELECT count(*) FROM outbox_dlq")
        conn.commit()
        assert dead == 0, farm.log_tail()
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM outbox") == 0, "empty outbox", 60)
        code, _ = farm.stop()
        assert code == 0


def whereabouts(dsn: str, private: Broker, missing: set[int]) -> str:
    """Where the rows that never arrived are: still in the outbox (the relay holds them),
    dead-lettered (with why), or neither (acknowledged by the broker, yet not in its log); with
    the broker's last words."""
    with psycopg.connect(dsn) as conn:
        held = scalar(conn, "SELECT count(*) FROM outbox WHERE id = ANY(%s)", [list(missing)])
        dead = conn.execute(
            "SELECT count(*), min(failure_reason), min(last_exception) FROM outbox_dlq"
            " WHERE id = ANY(%s)",
            [list(missing)],
        ).fetchone()
    log = private.work / f"{private.kind}.log"
    tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
    return (
        f"{len(missing)} missing: {held} still in the outbox, {dead} dead-lettered, the rest "
        f"acknowledged but not at the broker\nbroker's log:\n{tail}"
    )


def arrive(
    dsn: str,
    private: Broker,
    ids: set[int],
    farm: RunningFarm,
    *,
    since: float | None = None,
    within: float = WITHIN,
) -> None:
    """Wait until every row of `ids` is at the broker: within `within` seconds of `since` (a
    restart), though the wait goes on longer, to tell how long it took."""
    began = time.monotonic() if since is None else since
    missing = lambda: ids - row_ids(private.arrived())  # noqa: E731
    if not poll(lambda: not missing(), 120, every=0.5, process=farm):
        where = whereabouts(dsn, private, missing())
        pytest.fail(f"not every row at the broker within 120s: {where}\n{farm.log_tail()}")
    took = time.monotonic() - began
    assert took <= within, f"every row arrived {took:.1f}s after the restart, not {within:g}"
