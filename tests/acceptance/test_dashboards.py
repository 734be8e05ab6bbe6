"""The shipped Grafana dashboard and Prometheus alert rules: valid, tested with promtool, and
naming only metrics a real farm exports.

The rule tests need promtool (Debian/Ubuntu: `apt-get install -y --no-install-recommends
prometheus`; the README's test block installs it); without it they are skipped, saying so,
except in CI, where they fail. The metric test runs a farm that acks, retries, dead-letters,
fails a DLQ write, loses a lease, loses a worker and expires an old DLQ row, so every counter
the files name has been written at least once, and then reads /metrics.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.acceptance.test_farm import farm_process
from tests.steps import publish, wait_for
from tests.tools import missing_tool

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "outbox-farm-alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "outbox-farm-alerts.test.yml"
DASHBOARD = DEPLOY / "grafana" / "outbox-farm.json"
METRIC = re.compile(r"\boutbox_farm_[a-z_]+\b")
# Labels the dashboard's panels group by.
GROUPED_BY = {("outbox_farm_dlq_rows", "reason")}

PROMTOOL = shutil.which("promtool")


@pytest.fixture
def promtool() -> str:
    """promtool's path (Debian's prometheus package), or the test skips, or fails in CI."""
    if PROMTOOL is None:
        missing_tool(
            "promtool is not installed (apt-get install -y --no-install-recommends prometheus)"
        )
    assert PROMTOOL is not None
    return PROMTOOL


DASHAPP = '''\
"""Every outcome a dashboard shows, on its own queue."""
import asyncio

from outbox_farm import ConstantBackoff, Farm, Message, NoRetry

farm = Farm(table="outbox", dlq_table="outbox_dlq")


@farm.handler("ok")
async def ok(msg: Message) -> None:
    pass


@farm.handler("flaky", retry=ConstantBackoff(0.1))
async def flaky(msg: Message) -> None:
    if msg.attempts_count == 0:
        raise RuntimeError("first attempt fails")


@farm.handler("bad", retry=NoRetry())
async def bad(msg: Message) -> None:
    raise ValueError("always fails")


@farm.handler("broken", retry=NoRetry())
async def broken(msg: Message) -> None:
    raise ValueError("fails, and the DLQ refuses it")


@farm.handler("slow")
async def slow(msg: Message) -> None:
    await asyncio.sleep(3)  # still running when the test takes its lease away
'''

REFUSE_BROKEN = """
CREATE FUNCTION refuse_broken() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN IF NEW.queue = 'broken' THEN RAISE EXCEPTION 'DLQ refuses queue broken'; END IF;
RETURN NEW; END $$;
CREATE TRIGGER refuse_broken BEFORE INSERT ON outbox_dlq FOR EACH ROW
EXECUTE FUNCTION refuse_broken();
"""


def named_metrics() -> set[str]:
    """Every outbox_farm_* name in the alert rules and the dashboard's queries."""
    texts = [RULES.read_text()]
    dashboard = json.loads(DASHBOARD.read_text())
    texts += [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    return {name for text in texts for name in METRIC.findall(text)}


def test_the_alert_rules_are_valid(promtool: str) -> None:
    result = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 8 rules found" in result.stdout


def test_the_alert_rules_fire_when_they_should_and_only_then(promtool: str) -> None:
    result = subprocess.run(
        [promtool, "test", "rules", RULE_TESTS.name],
        cwd=RULE_TESTS.parent,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_the_issue_asks_for_is_there() -> None:
    alerts = set(re.findall(r"- alert: (\w+)", RULES.read_text()))
    assert alerts == {
        "OutboxFarmDown",
        "OutboxBacklogGrowing",
        "OutboxOldestReadyTooOld",
        "OutboxTerminalRateSpike",
        "OutboxDlqWriteFailed",
        "OutboxLeaseLostSustained",
        "OutboxWorkersRestarting",
        "OutboxQueueStalled",
    }
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert tested == alerts


def test_the_dashboard_has_the_two_views_and_well_formed_panels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert [r.split(":")[0] for r in rows] == ["Outbox reliability", "Processing"]
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["description"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"]
        assert all(t["expr"] and t["refId"] for t in panel["targets"])
    titles = {p["title"] for p in panels}
    for needed in (
        "Backlog",
        "Delivery latency p99",
        "Retries and exhaustion",
        "DLQ routing",
        "Consumption rate",
        "Failure ratio",
        "DLQ volume",
    ):
        assert needed in titles


def scrape(farm: Any) -> dict[str, set[frozenset[str]]]:
    """Sample name -> the label-name sets it is exported with."""
    found: dict[str, set[frozenset[str]]] = {}
    for sample in farm.samples():
        found.setdefault(sample.name, set()).add(frozenset(sample.labels))
    return found


@pytest.fixture
def farm_metrics(tmp_path: Path, dsn: str, conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """/metrics of a farm that went through every outcome."""
    (tmp_path / "dashapp.py").write_text(DASHAPP)
    conn.execute(REFUSE_BROKEN)
    conn.execute(
        "INSERT INTO outbox_dlq (original_id, queue, payload, deliveries_count, created_at, "
        "failed_at, failure_reason) VALUES (1, 'ok', 'x', 1, now(), now() - interval '2 days', "
        "'rejected')"
    )
    wanted = named_metrics()
    with farm_process(tmp_path, dsn, "--dlq-retention", "1d", app="dashapp:farm", procs=2) as farm:
        wait_for(lambda: farm.healthy(2), "a healthy farm", 30, farm)
        # The housekeeper purges the 2-day-old DLQ row in its first retention pass, at boot;
        # the next pass is a minute later. Killed between that DELETE's commit and the counter
        # it feeds (a window a loaded machine widens), the row would be gone and the counter
        # never written. So the victim dies only once the purge is counted (a dead process's
        # counters stay in /metrics).
        wait_for(lambda: "outbox_farm_dlq_purged_total" in scrape(farm), "the DLQ purge", 30, farm)
        # Killed before any row exists: killed later, it could take unwritten outcomes (a
        # retry, a DLQ move) with it, and the counters they feed would never be written.
        victim = sorted(farm.children())[0]
        os.kill(victim, signal.SIGKILL)
        wait_for(
            lambda: len(kids := farm.children()) == 2 and victim not in kids and farm.healthy(2),
            "a replaced worker",
            30,
            farm,
        )
        for queue in ("ok", "flaky", "bad", "broken", "slow"):
            publish(conn, 3, queue=queue)
        taken = wait_for(
            lambda: conn.execute(
                "UPDATE outbox SET acquired_token = gen_random_uuid() "
                "WHERE queue = 'slow' AND acquired_token IS NOT NULL RETURNING id"
            ).fetchall(),
            "a leased row of queue slow",
            20,
            farm,
        )
        assert taken
        missing: set[str] = set()

        def complete() -> dict[str, set[frozenset[str]]]:
            found = scrape(farm)
            missing.clear()
            missing.update(wanted - set(found) if found else {"(no /metrics answer)"})
            return {} if missing else found

        try:
            return wait_for(complete, "every metric the dashboards name", 60, farm)
        except pytest.fail.Exception as exc:
            raise pytest.fail.Exception(f"still missing {sorted(missing)}: {exc}") from None


@pytest.mark.slow
def test_every_metric_the_files_name_is_exported_by_a_farm(farm_metrics: dict[str, Any]) -> None:
    missing = named_metrics() - set(farm_metrics)
    assert missing == set()


@pytest.mark.slow
def test_the_dlq_gauge_has_the_labels_the_dashboard_groups_by(
    farm_metrics: dict[str, Any],
) -> None:
    for name, label in GROUPED_BY:
        assert any(label in labels for labels in farm_metrics[name])
