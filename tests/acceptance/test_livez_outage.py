"""/livez through a database outage, on a real `outbox-farm start`: the arbiter lives and its
loop turns, so /livez stays 200 while /healthz is 503 and the farm waits for its database; it
turns 503 only when the arbiter itself stops (SIGSTOP here), and 200 again when it goes on.

The database is reached through the TCP relay of `test_arbiter_outage`, which the test cuts and
restores: the shared server is never touched. Every wait is a deadline-bounded poll.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from outbox_farm.prefork.exposition import STALE_AFTER
from tests.acceptance import test_arbiter_outage
from tests.acceptance.test_arbiter_outage import Relay
from tests.acceptance.test_farm import FARMAPP, RunningFarm, farm_process, scalar
from tests.steps import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.one_server]
relay = test_arbiter_outage.relay  # the fixture: a relay to the test's database


def livez(farm: RunningFarm) -> tuple[int, dict[str, Any]] | None:
    """(status, JSON body; {} for any other body), or None while nothing answers."""
    got = farm.get("/livez")
    if got is None:
        return None
    return got[0], json.loads(got[1]) if got[0] in (200, 503) else {}


def live(farm: RunningFarm) -> bool:
    got = livez(farm)
    return got is not None and got[0] == 200


def test_livez_stays_200_through_a_database_outage_and_fails_only_with_the_arbiter(
    tmp_path: Path, dsn: str, conn: psycopg.Connection[Any], relay: Relay
) -> None:
    (tmp_path / "farmapp.py").write_text(FARMAPP)
    relayed = make_conninfo(dsn, host="127.0.0.1", port=relay.port, connect_timeout=5)
    with farm_process(tmp_path, relayed, procs=1) as farm:
        wait_for(lambda: farm.healthy(1), "a healthy worker", 30, farm)
        assert livez(farm) == (200, {"arbiter": farm.pid})

        relay.cut()
        outage: list[bool] = []

        def unready() -> bool:
            outage.append(live(farm))
            got = farm.health()
            return got is not None and got[0] == 503

        wait_for(unready, "/healthz 503 without the database", 90, farm)
        # Longer than a stale snapshot takes to show: the arbiter kept publishing all along.
        until = time.monotonic() + STALE_AFTER + 2
        while time.monotonic() < until:
            outage.append(live(farm))
            time.sleep(0.2)
        got = farm.health()
        assert got is not None
        assert got[0] == 503, got
        print("/healthz during the outage:", got)  # shown with -s
        assert len(outage) > 1
        assert all(outage), outage

        # The control: the same endpoint fails once the arbiter's loop stops turning.
        os.kill(farm.pid, signal.SIGSTOP)
        try:
            stopped = wait_for(
                lambda: (got := livez(farm)) is not None and got[0] == 503 and got[1],
                "/livez 503 for a stopped arbiter",
                STALE_AFTER + 30,
                farm,
            )
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(farm.pid, signal.SIGCONT)
        assert any(p.startswith("arbiter not responding for ") for p in stopped["problems"])
        wait_for(lambda: live(farm), "/livez 200 once the arbiter goes on", 30, farm)

        relay.restore()
        wait_for(lambda: farm.healthy(1), "a healthy worker after the outage", 60, farm)
        assert scalar(conn, "SELECT count(*) FROM outbox") == 0
        code, _ = farm.stop()
    assert code == 0, farm.log_tail()
