"""Which database a command runs on: the one its DSN names, or the embedded server when told to
(`--embedded`); with neither, it stops before anything starts, saying how to give one.

A command that started the embedded server unasked would create a data directory in the
working directory and answer from that empty database; the `outbox-farm migrate` it then
suggested would migrate it instead of the user's. Only `demo` runs there unasked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.acceptance.test_cli import run

USAGE_ERROR = 2
# Every command that works on a database, as run without any.
DATABASE_COMMANDS = {
    "migrate": ["migrate"],
    "check": ["check"],
    "stats": ["stats", "--metrics-url", ""],
    "dlq list": ["dlq", "list"],
    "queue list": ["queue", "list"],
    "dlq show": ["dlq", "show", "1"],
    "dlq replay": ["dlq", "replay", "--all", "--yes"],
    "dlq purge": ["dlq", "purge", "--all", "--yes"],
    "doctor": ["doctor"],
    "console": ["console", "--bind", "127.0.0.1:0"],
    "start": ["start", "app:farm", "--procs", "1", "--metrics-bind", ""],
}
# Those that finish on a migrated database with nothing in it, exit status 0.
FINISHING = ("migrate", "check", "stats", "dlq list", "doctor", "queue list")


@pytest.mark.parametrize("command", DATABASE_COMMANDS)
def test_without_a_dsn_a_command_stops_and_says_how_to_give_one(
    command: str, tmp_path: Path
) -> None:
    result = run(*DATABASE_COMMANDS[command], cwd=str(tmp_path))
    assert result.returncode == USAGE_ERROR, result.stdout + result.stderr
    assert "no database given" in result.stderr
    for way in ("--dsn-file", "OUTBOX_FARM_DSN_FILE", "OUTBOX_FARM_DSN", "--dsn", "--embedded"):
        assert way in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / ".outbox-farm").exists()
    # The way out it names is there: the command takes --embedded.
    shown = run(*command.split(), "--help")
    assert shown.returncode == 0, shown.stderr
    assert "--embedded" in shown.stdout


@pytest.mark.parametrize("command", FINISHING)
def test_given_a_dsn_the_same_commands_run_on_it(command: str, dsn: str, tmp_path: Path) -> None:
    result = run(*DATABASE_COMMANDS[command], cwd=str(tmp_path), OUTBOX_FARM_DSN=dsn)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "embedded" not in result.stderr
    assert not (tmp_path / ".outbox-farm").exists()


def test_an_empty_dsn_variable_is_not_offered_as_the_way_out(tmp_path: Path) -> None:
    result = run("stats", cwd=str(tmp_path), OUTBOX_FARM_DSN="")
    assert result.returncode == USAGE_ERROR, result.stdout + result.stderr
    assert "OUTBOX_FARM_DSN is set but empty" in result.stderr
    advice = " ".join(result.stderr.split("set but empty", 1)[1].split())
    assert "--dsn-file" in advice  # the other places are offered
    assert re.search(r"OUTBOX_FARM_DSN(?!_FILE)", advice) is None, advice
    assert not (tmp_path / ".outbox-farm").exists()


def test_embedded_and_a_dsn_together_are_refused(dsn: str, tmp_path: Path) -> None:
    result = run("migrate", "--embedded", cwd=str(tmp_path), OUTBOX_FARM_DSN=dsn)
    assert result.returncode == USAGE_ERROR, result.stdout + result.stderr
    assert "--embedded and a DSN (--dsn, OUTBOX_FARM_DSN or --dsn-file) are both given" in (
        result.stderr
    )
    assert not (tmp_path / ".outbox-farm").exists()
