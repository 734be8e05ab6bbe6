"""A worker whose data path keeps failing is replaced, end to end.

The runtime restarts a component that raises unexpectedly; when a fetcher fails five times in a
minute it declares itself broken (`Runtime.fatal`). This test checks what happens after that in
real processes: the worker drains and exits with status 1, the arbiter books it as a crash and
forks a replacement, and the farm itself never stops. The fault is injected by the app module,
which every worker imports after the fork: it replaces the fetcher's claim of queue `broken` by
one that raises, so the other queue keeps its rows flowing throughout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.acceptance.test_farm import farm_process, json_entries
from tests.steps import publish, wait_for

pytestmark = pytest.mark.slow

BROKENAPP = '''\
"""A farm whose `broken` queue cannot claim: its fetcher raises a bug, every time."""
from outbox_farm import Farm, Message
from outbox_farm.worker import fetcher

farm = Farm(table="outbox", dlq_table="outbox_dlq")
_claim = fetcher.Fetcher._claim


async def _broken_claim(self, limit):
    if self.spec.queue == "broken":
        raise RuntimeError("injected: the claim code has a bug")
    return await _claim(self, limit)


fetcher.Fetcher._claim = _broken_claim


@farm.handler("ok")
async def ok(msg: Message) -> None:
    pass


@farm.handler("broken")
async def broken(msg: Message) -> None:
    pass
'''


def test_a_worker_whose_fetcher_keeps_failing_exits_1_and_is_replaced(
    tmp_path: Path, dsn: str, conn: psycopg.Connection[Any]
) -> None:
    (tmp_path / "brokenapp.py").write_text(BROKENAPP)
    with farm_process(tmp_path, dsn, "--log-format", "json", app="brokenapp:farm", procs=1) as farm:

        def events(name: str) -> list[dict[str, Any]]:
            return [e for e in json_entries(farm.log()) if e.get("event") == name]

        failed = wait_for(lambda: events("worker_failed"), "worker_failed event", 90, farm)
        assert "fetcher" in failed[0]["message"], failed[0]
        died = wait_for(lambda: events("worker_died"), "worker_died event", 60, farm)
        assert died[0].get("exit") == "status 1", died[0]
        assert died[0].get("reason") == "crash", died[0]
        # The traceback of every failure was logged, not swallowed.
        assert "RuntimeError: injected: the claim code has a bug" in farm.log()
        # A replacement was forked, and it runs the healthy queue's rows.
        wait_for(lambda: len(events("worker_failed")) >= 2, "second broken worker", 90, farm)
        publish(conn, 1, queue="ok")
        wait_for(
            lambda: (
                conn.execute("SELECT count(*) FROM outbox WHERE queue = 'ok'").fetchone() == (0,)
            ),
            "the ok queue's row delivered by a replacement",
            60,
            farm,
        )
        assert farm.proc.poll() is None, "the farm stopped"
        assert not events("halt"), events("halt")
