"""A queue's breaker across the processes of `outbox-farm start`: a downstream down for a
minute under a backlog of 10,000 rows dead-letters nothing, spends at most the breaker's
failures plus one attempt per probe, and the backlog is delivered within 10 s of the
downstream's recovery."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox_farm import Farm
from tests.acceptance.test_farm import farm_process, scalar
from tests.steps import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.one_server]

FAILURES, PROBE_EVERY, OUTAGE, ROWS = 5, 2.0, 60.0, 10_000

BREAKERAPP = f'''\
"""Acceptance-test app: queue "q" sends to a downstream that is down while the file named by
BREAKERAPP_DOWN exists."""
import os

from outbox_farm import Breaker, Farm, Message

DOWN = os.environ["BREAKERAPP_DOWN"]
farm = Farm(table="outbox", dlq_table="outbox_dlq")


@farm.handler("q", breaker=Breaker(failures={FAILURES}, probe_every={PROBE_EVERY}))
async def send(msg: Message) -> None:
    if os.path.exists(DOWN):
        raise ConnectionRefusedError("downstream refused the connection")
'''


def probes(log: str) -> int:
    found = 0
    for line in log.splitlines():
        try:
            found += json.loads(line).get("event") == "breaker_probe"
        except (ValueError, AttributeError):
            continue
    return found


def test_an_outage_under_a_backlog_spends_the_failures_and_the_probes_only(
    dsn: str, conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    (tmp_path / "breakerapp.py").write_text(BREAKERAPP)
    down = tmp_path / "down"
    down.touch()
    Farm(table="outbox", dlq_table="outbox_dlq").publish_batch(
        conn, [{"n": n} for n in range(ROWS)], queue="q"
    )
    env = {"BREAKERAPP_DOWN": str(down)}
    with farm_process(
        tmp_path, dsn, "--log-format", "json", procs=2, app="breakerapp:farm", **env
    ) as farm:
        wait_for(lambda: farm.healthy(2), "the farm healthy", 60)
        wait_for(
            lambda: (
                scalar(
                    conn,
                    "SELECT count(*) FROM outbox_farm_queues WHERE breaker_open_since IS NOT NULL",
                )
                == 1
            ),
            "the breaker open",
            30,
        )
        wait_for(lambda: "breaker open" in json.dumps(farm.health()), "/healthz saying so", 30)
        wait_for(lambda: farm.metric("outbox_farm_breaker_open", queue="q"), "the gauge", 30)
        time.sleep(OUTAGE)  # the outage's length: what is measured is what it cost
        attempts = scalar(conn, "SELECT sum(attempts_count) FROM outbox")
        spent_probes = probes(farm.log())
        dead = scalar(conn, "SELECT count(*) FROM outbox_dlq")
        down.unlink()
        recovered = time.monotonic()
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM outbox") == 0, "the backlog", 60)
        drained_in = time.monotonic() - recovered
        code, _ = farm.stop()
    print(f"attempts {attempts}, probes {spent_probes}, drained {drained_in:.1f}s after")
    assert dead == 0
    assert scalar(conn, "SELECT count(*) FROM outbox_dlq") == 0
    assert spent_probes <= OUTAGE / PROBE_EVERY + 2
    assert attempts <= FAILURES + spent_probes
    assert drained_in <= 10.0
    assert code == 0
