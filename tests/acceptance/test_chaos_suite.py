"""The chaos suite's verdict: a scenario that breaks an invariant fails the run, and the
output names the scenario and the invariant (the suite itself runs in `make chaos`, and two
scenarios of it in CI)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.chaos import __main__ as chaos
from loadtests.chaos.checks import Context, Finding, Result


def broken(ctx: Context) -> Result:
    return Result(
        "broken",
        published=10,
        handled=9,
        duplicates=2,
        explained=False,
        lost=1,
        findings=[
            Finding("dlq-exactly-once", False, "1 message(s) missing from the DLQ: abc (poison)"),
            Finding("drains", True),
        ],
    )


def sound(ctx: Context) -> Result:
    return Result("sound", published=10, handled=10, recovery=1.5, findings=[Finding("x", True)])


def crashing(ctx: Context) -> Result:
    raise RuntimeError("the farm did not start")


@pytest.fixture
def scenarios(monkeypatch: pytest.MonkeyPatch, server_dsn: str, tmp_path: Path) -> None:
    monkeypatch.setattr(
        chaos, "SCENARIOS", {"broken": broken, "sound": sound, "crashing": crashing}
    )


@pytest.mark.usefixtures("scenarios")
def test_a_broken_invariant_fails_the_run_naming_scenario_and_invariant(
    server_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status = chaos.main(["--dsn", server_dsn, "--scenario", "sound,broken,crashing"])
    out = capsys.readouterr().out
    assert status == 1
    assert "FAILED broken: dlq-exactly-once: 1 message(s) missing from the DLQ" in out
    assert "FAILED crashing: ran-to-the-end: RuntimeError('the farm did not start')" in out
    assert "1 of 3 scenarios passed" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:1].isalpha()}
    assert rows["sound"][1:8] == ["PASS", "10", "10", "0", "all", "0", "1.5s"]
    assert rows["broken"][1:7] == ["FAIL", "10", "9", "2", "NO", "1"]


@pytest.mark.usefixtures("scenarios")
def test_a_clean_run_exits_0_and_unknown_scenarios_are_refused(
    server_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert chaos.main(["--dsn", server_dsn, "--scenario", "sound"]) == 0
    assert "1 of 1 scenarios passed" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        chaos.main(["--dsn", server_dsn, "--scenario", "nope"])
    assert "unknown scenario(s) ['nope']" in capsys.readouterr().err
