"""The chaos scenario breaker-outage, run short: a `--procs 2` farm under steady load, one
queue's downstream down behind a breaker, another queue held to a farm-wide rate. Every
invariant of the scenario must hold (`loadtests/chaos/breaker_outage.py` says which), and the
ones this scenario exists for must be among them: a run that skipped a check proves nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.chaos import breaker_outage
from loadtests.chaos.checks import Context

pytestmark = [pytest.mark.slow, pytest.mark.one_server]

SCALE = 0.3  # a 9 s outage between 3 s of load before and after, as the smoke runs are cut

OWN = {
    "breaker-shows-open",
    "breaker-opened-and-closed-once",
    "healthz-degraded-not-failing",
    "healthz-clear-after-recovery",
    "no-dead-letters-of-the-outage",
    "attempts-within-failures-and-probes",
    "one-probe-per-interval",
    "outage-backlog-delivered-after-recovery",
    "limited-rate-held",
    "rated-drained-under-its-limit",
}
CHECKER = {"success-at-least-once", "outbox-empty", "dlq-exactly-once", "acks-equal-successes"}


@pytest.mark.timeout(600)
def test_an_outage_behind_a_breaker_beside_a_limit_breaks_no_invariant(
    server_dsn: str, tmp_path: Path
) -> None:
    result = breaker_outage.scenario_run(Context(server_dsn, tmp_path, SCALE))
    print(f"{result.scenario}: {result.note}")
    failed = [f"{f.name}: {f.detail}" for f in result.failures()]
    assert not failed, "\n".join(failed)
    unchecked = (OWN | CHECKER) - {f.name for f in result.findings}
    assert not unchecked, f"not checked: {sorted(unchecked)}"
    assert result.published > 0
    assert result.lost == 0
    assert result.handled == result.published
