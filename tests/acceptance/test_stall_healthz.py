"""A stalled queue turns a real farm's /healthz 503 and shows on /metrics (issue 25, item 3).

`outbox-farm start` runs the acceptance app (queue "q", recording each handled row in a
ledger). Once it is healthy and has delivered a first row, a trigger (another writer's, say)
refuses every claim of the queue: /healthz must turn 503 naming the queue and the error, and
/metrics count the failed claims and flag the queue stalled. Dropping the trigger must bring
back 200, clear the flag and deliver the rows that waited. Every wait is a deadline-bounded
poll.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.acceptance.test_farm import FARMAPP, RunningFarm, farm_process, scalar
from tests.steps import publish, wait_for

pytestmark = pytest.mark.slow

REFUSAL = "claims of queue q are refused here"
REFUSE = f"""
CREATE FUNCTION refuse_claims() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
    IF NEW.queue = 'q' AND NEW.acquired_token IS NOT NULL THEN
        RAISE EXCEPTION '{REFUSAL}';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER refuse BEFORE UPDATE ON outbox FOR EACH ROW EXECUTE FUNCTION refuse_claims()
"""


def handled(conn: psycopg.Connection[Any]) -> set[int]:
    return {int(r[0]) for r in conn.execute("SELECT id FROM ledger")}


def problems(farm: RunningFarm) -> list[str] | None:
    """The problems of a 503 /healthz; None while it answers anything else."""
    got = farm.health()
    if got is None or got[0] != 503:
        return None
    return list(got[1].get("problems", []))


def test_a_queue_whose_claims_keep_failing_turns_healthz_503_until_it_flows_again(
    tmp_path: Path, dsn: str, conn: psycopg.Connection[Any]
) -> None:
    (tmp_path / "farmapp.py").write_text(FARMAPP)
    conn.execute("CREATE TABLE ledger (id bigint NOT NULL, pid int NOT NULL)")
    with farm_process(tmp_path, dsn, procs=1, FARMAPP_LEDGER="1") as farm:
        wait_for(lambda: farm.healthy(1), "a healthy farm", 30, farm)
        first = set(publish(conn, 1, queue="q"))
        wait_for(lambda: handled(conn) >= first, "the first row delivered", 30, farm)
        assert farm.metric("outbox_farm_queue_stalled", queue="q") in (None, 0)

        conn.execute(REFUSE)
        waiting = set(publish(conn, 5, queue="q"))
        found = wait_for(lambda: problems(farm), "/healthz 503 with a problem", 60, farm)
        assert any("queue q" in p and REFUSAL in p for p in found), found
        wait_for(
            lambda: farm.metric("outbox_farm_queue_stalled", queue="q") == 1,
            "outbox_farm_queue_stalled{queue=q} 1",
            30,
            farm,
        )
        assert (farm.metric("outbox_farm_claim_errors_total", queue="q") or 0) > 0
        assert not handled(conn) & waiting
        assert scalar(conn, "SELECT count(*) FROM outbox WHERE acquired_token IS NOT NULL") == 0

        conn.execute("DROP TRIGGER refuse ON outbox")
        wait_for(lambda: handled(conn) >= waiting, "the waiting rows delivered", 60, farm)
        wait_for(lambda: farm.healthy(1), "/healthz 200 again", 30, farm)
        wait_for(
            lambda: farm.metric("outbox_farm_queue_stalled", queue="q") == 0,
            "outbox_farm_queue_stalled{queue=q} 0",
            30,
            farm,
        )
        wait_for(
            lambda: scalar(conn, "SELECT count(*) FROM outbox") == 0, "an empty outbox", 30, farm
        )
        code, _ = farm.stop()
    assert code == 0, farm.log_tail()
