"""What the documentation promises of the command line, checked on real processes: `--json` on
`check` and `migrate`, `dlq list --json` printing the array its help names, and the options
that read an environment variable (OUTBOX_FARM_<OPTION>) doing so, each with its effect.

That every option of every command either names its variable in its help or is on the short
list of command-line-only options is checked without a database, in the last test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import click
import psycopg

from outbox_farm.cli import main
from outbox_farm.names import TableNames
from tests.acceptance.test_cli import CLI, migration_labels, run
from tests.acceptance.test_ops_cli import NO_FARM, fail
from tests.steps import wait_for

Conn = psycopg.Connection[Any]


def _json(result: subprocess.CompletedProcess[str], code: int = 0) -> Any:
    assert result.returncode == code, result.stdout + result.stderr
    return json.loads(result.stdout)


# -- --json on check and migrate ---------------------------------------------------------------


def test_check_json_reports_ok_and_drift_with_the_exit_status_of_the_text(
    dsn: str, empty_dsn: str
) -> None:
    ok = _json(run("check", "--dsn", dsn, "--json"))
    assert ok == {
        "ok": True,
        "problems": [],
        "notes": ok["notes"],
        "tables": ["outbox", "outbox_dlq"],
    }
    drift = _json(run("check", "--dsn", empty_dsn, "--json"), code=1)
    assert drift["ok"] is False
    assert any("outbox" in problem for problem in drift["problems"])


def test_migrate_json_lists_the_migrations_and_keeps_progress_off_stdout(empty_dsn: str) -> None:
    labels = migration_labels(TableNames.build("outbox", "outbox_dlq"))
    first = run("migrate", "--dsn", empty_dsn, "--json")
    data = _json(first)
    assert data == {
        "applied": labels,
        "already": [],
        "repaired": [],
        "tables": ["outbox", "outbox_dlq"],
    }
    assert "applying" in first.stderr  # the progress lines, on stderr
    again = _json(run("migrate", "--dsn", empty_dsn, "--json"))
    assert again["applied"] == []
    assert again["already"] == labels


def test_sql_has_no_json_and_says_its_output_is_sql() -> None:
    shown = run("sql", "--help").stdout
    assert "--json" not in shown.split("Options:")[1]
    assert "SQL text (no --json)" in shown


# -- dlq list --json: an array -------------------------------------------------------------------


def test_dlq_list_json_is_the_array_its_help_names(dsn: str, conn: Conn) -> None:
    fail(conn, 2)
    rows = _json(run("dlq", "list", "--dsn", dsn, "--json"))
    assert isinstance(rows, list)
    assert len(rows) == 2
    assert rows[0]["id"] > rows[1]["id"]  # newest first
    shown = " ".join(run("dlq", "list", "--help").stdout.split())
    assert "Print JSON (an array of rows, newest first; with --group, of causes" in shown
    assert "one object" not in shown


# -- the options' environment variables, each with its effect --------------------------------


def test_outbox_farm_json_makes_any_command_print_json(dsn: str) -> None:
    assert _json(run("check", "--dsn", dsn, OUTBOX_FARM_JSON="1"))["ok"] is True
    assert _json(run("doctor", "--dsn", dsn, OUTBOX_FARM_JSON="true"))["ok"] is True


def test_outbox_farm_queue_narrows_stats_and_dlq_list(dsn: str, conn: Conn) -> None:
    conn.execute("INSERT INTO outbox (queue, payload) VALUES ('orders', 'x'), ('mail', 'y')")
    fail(conn, 1, queue="orders")
    fail(conn, 1, queue="mail")
    stats = _json(run("stats", "--dsn", dsn, *NO_FARM, "--json", OUTBOX_FARM_QUEUE="mail"))
    assert [q["queue"] for q in stats["queues"]] == ["mail"]
    rows = _json(run("dlq", "list", "--dsn", dsn, "--json", OUTBOX_FARM_QUEUE="orders"))
    assert [r["queue"] for r in rows] == ["orders"]


def test_outbox_farm_since_narrows_dlq_list(dsn: str, conn: Conn) -> None:
    (old,) = fail(conn, 1, age="3 hours")
    (new,) = fail(conn, 1)
    every = _json(run("dlq", "list", "--dsn", dsn, "--json"))
    assert {r["id"] for r in every} == {old, new}
    recent = _json(run("dlq", "list", "--dsn", dsn, "--json", OUTBOX_FARM_SINCE="1h"))
    assert [r["id"] for r in recent] == [new]


def test_a_filter_from_the_environment_never_makes_a_selection_by_itself(
    dsn: str, conn: Conn
) -> None:
    fail(conn, 2, queue="orders")
    refused = run("dlq", "purge", "--dsn", dsn, "--yes", OUTBOX_FARM_QUEUE="orders")
    assert refused.returncode == 2
    assert "on the command line" in refused.stderr
    typed = _json(
        run("dlq", "purge", "--dsn", dsn, "--reason", "retry_terminal", "--dry-run", "--json")
    )
    assert typed["matched"] == 2  # a filter typed on the command line selects


def test_outbox_farm_exact_limit_turns_counts_into_estimates(dsn: str, conn: Conn) -> None:
    conn.execute(
        "INSERT INTO outbox (queue, payload) SELECT 'orders', 'x' FROM generate_series(1, 3)"
    )
    exact = _json(run("stats", "--dsn", dsn, *NO_FARM, "--json"))
    assert exact["queues"][0]["counts"]["ready"] == {"value": 3, "exact": True}
    capped = _json(run("stats", "--dsn", dsn, *NO_FARM, "--json", OUTBOX_FARM_EXACT_LIMIT="1"))
    assert capped["queues"][0]["counts"]["ready"]["exact"] is False
    bad = run("stats", "--dsn", dsn, *NO_FARM, OUTBOX_FARM_EXACT_LIMIT="-1")
    assert bad.returncode == 2
    assert "--exact-limit" in bad.stderr


def test_outbox_farm_max_lag_sets_doctors_lag_limit(dsn: str, conn: Conn) -> None:
    conn.execute(
        "INSERT INTO outbox (queue, payload, next_attempt_at) "
        "VALUES ('orders', 'x', now() - interval '30 seconds')"
    )

    def lag_check(**env: str) -> dict[str, Any]:
        data = _json(run("doctor", "--dsn", dsn, "--json", "--max-stall", "1h", **env))
        (check,) = [c for c in data["checks"] if c["name"] == "oldest ready row"]
        return dict(check)

    assert lag_check()["status"] == "OK"  # 30 s, within the default 60 s
    assert lag_check(OUTBOX_FARM_MAX_LAG="10s")["status"] == "WARN"


def test_outbox_farm_max_xmin_age_sets_doctors_xmin_limit(dsn: str) -> None:
    with psycopg.connect(dsn) as other:
        other.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        other.execute("SELECT 1")
        time.sleep(1.2)  # the snapshot outlives the 1 s limit: time passes on purpose
        default = run("doctor", "--dsn", dsn)
        strict = run("doctor", "--dsn", dsn, OUTBOX_FARM_MAX_XMIN_AGE="1s")
    assert "FAIL xmin horizon" not in default.stdout  # 5 minutes by default
    assert strict.returncode == 1
    assert "FAIL xmin horizon: oldest holder: session pid" in strict.stdout


def test_outbox_farm_watch_makes_stats_redraw(dsn: str, tmp_path: Path) -> None:
    output = tmp_path / "watch.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_FARM_")}
    env["OUTBOX_FARM_WATCH"] = "0.2"
    with output.open("w") as sink:
        proc = subprocess.Popen(
            [CLI, "stats", "--dsn", dsn, *NO_FARM, "--json"],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            wait_for(lambda: len(output.read_text().splitlines()) >= 3, "3 frames", 20)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    frames = [json.loads(line) for line in output.read_text().splitlines() if line.startswith("{")]
    assert len(frames) >= 3  # one compact object a line per redraw


# -- the rule, for every option of every command ---------------------------------------------

# Options read from the command line only, and why: what selects or confirms rows to change
# must be typed (an environment left over from another command must never purge or replay),
# and a per-run choice (how many to list, a dry run) is not a setting.
COMMAND_LINE_ONLY = {
    # Per-change values of the queue controls: one exported by mistake would apply to every
    # pause or limit run from that shell.
    ("queue", "limit", "--rate"),
    ("queue", "limit", "--max-running"),
    ("queue", "limit", "--per-key-running"),
    ("queue", "limit", "--clear"),
    ("queue", "pause", "--until"),
    ("queue", "pause", "--for"),
    ("queue", "pause", "--reason"),
    ("dlq", "list", "--limit"),
    ("dlq", "list", "--group"),
    ("dlq", "replay", "--all"),
    ("dlq", "replay", "--to-queue"),
    ("dlq", "replay", "--delay"),
    ("dlq", "replay", "--batch"),
    ("dlq", "replay", "--dry-run"),
    ("dlq", "replay", "--yes"),
    ("dlq", "purge", "--older-than"),
    ("dlq", "purge", "--all"),
    ("dlq", "purge", "--batch"),
    ("dlq", "purge", "--dry-run"),
    ("dlq", "purge", "--yes"),
}


def _commands(group: click.Group, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    found: list[tuple[tuple[str, ...], Any]] = []
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            found += _commands(command, (*path, name))
        else:
            found.append(((*path, name), command))
    return found


def test_every_option_names_its_environment_variable_or_is_command_line_only() -> None:
    missing, wrong = [], []
    for path, command in _commands(main):
        for param in command.params:
            if not isinstance(param, click.Option) or param.name == "help":
                continue
            key = (*path, param.opts[0])
            if param.envvar is None:
                if key not in COMMAND_LINE_ONLY:
                    missing.append(" ".join(key))
                continue
            option = param.opts[0].lstrip("-").upper().replace("-", "_")
            # OUTBOX_FARM_<OPTION>, or OUTBOX_FARM_<COMMAND>_<OPTION> for a command's own
            # settings that must not leak into another's (the demo's --procs is not start's).
            expected = {f"OUTBOX_FARM_{option}", f"OUTBOX_FARM_{path[0].upper()}_{option}"}
            named = re.findall(r"\[env (\w+)\]", param.help or "")
            if named != [param.envvar] or param.envvar not in expected:
                wrong.append(f"{' '.join(key)}: envvar {param.envvar}, help names {named}")
    assert not missing, f"options without an environment variable: {missing}"
    assert not wrong, wrong


def test_a_bad_value_from_the_environment_names_the_option(dsn: str) -> None:
    bad = run("dlq", "list", "--dsn", dsn, OUTBOX_FARM_SINCE="not a time")
    assert bad.returncode == 2
    assert "--since" in bad.stderr
