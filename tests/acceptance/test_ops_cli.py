"""The operator's commands as an on-call engineer runs them: real processes, a real database."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.acceptance.test_cli import CLI, run
from tests.acceptance.test_farm import FARMAPP, farm_process
from tests.steps import publish, wait_for

Conn = psycopg.Connection[Any]
NO_FARM = ("--metrics-url", "")


def fail(conn: Conn, n: int, queue: str = "orders", age: str = "0 s", **cols: Any) -> list[int]:
    rows = conn.execute(
        "INSERT INTO outbox_dlq (original_id, queue, payload, headers, deliveries_count, "
        "created_at, failed_at, failure_reason, last_exception) "
        "SELECT g, %(queue)s, convert_to('{\"n\": ' || g || '}', 'UTF8'), "
        '\'{"content-type": "application/json"}\', 3, now(), now() - %(age)s::interval, '
        "%(reason)s, %(exc)s FROM generate_series(1, %(n)s) AS g RETURNING id",
        {
            "queue": queue,
            "age": age,
            "n": n,
            "reason": cols.get("reason", "retry_terminal"),
            "exc": cols.get("exc", "KeyError('sku')"),
        },
    ).fetchall()
    return [int(r[0]) for r in rows]


def out_json(*args: str, code: int = 0, **kw: Any) -> Any:
    result = run(*args, "--json", **kw)
    assert result.returncode == code, result.stderr + result.stdout
    return json.loads(result.stdout)


def counts(conn: Conn) -> tuple[int, int]:
    row = conn.execute(
        "SELECT (SELECT count(*) FROM outbox), (SELECT count(*) FROM outbox_dlq)"
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


# -- stats -----------------------------------------------------------------------------------


def test_stats_json_and_text(dsn: str, conn: Conn) -> None:
    publish(conn, 3, queue="orders")
    fail(conn, 2, reason="rejected")
    data = out_json("stats", "--dsn", dsn, *NO_FARM)
    (orders,) = data["queues"]
    assert orders["queue"] == "orders"
    assert orders["counts"]["ready"] == {"value": 3, "exact": True}
    assert orders["dlq"][0]["reason"] == "rejected"
    assert orders["dlq"][0]["last_hour"] == {"value": 2, "exact": True}
    assert data["farm"] == {"url": None}
    text = run("stats", "--dsn", dsn, *NO_FARM, "--exact-limit", "1")
    assert text.returncode == 0, text.stderr
    assert "ready" in text.stdout.splitlines()[0]
    assert "~" in text.stdout.splitlines()[1]  # 3 rows > the limit of 1: an estimate
    assert "DLQ by reason:" in text.stdout


def test_stats_says_when_the_farm_is_not_reachable(dsn: str) -> None:
    data = out_json("stats", "--dsn", dsn, "--metrics-url", "http://127.0.0.1:1/metrics")
    assert "cannot read the farm's metrics at http://127.0.0.1:1/metrics" in data["farm"]["error"]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_stats_watch_redraws_until_ctrl_c(dsn: str, conn: Conn, tmp_path: Path) -> None:
    publish(conn, 1, queue="orders")
    output = tmp_path / "watch.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_FARM_")}
    with output.open("w") as sink:
        proc = subprocess.Popen(
            [CLI, "stats", "--dsn", dsn, *NO_FARM, "--watch", "0.2"],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
            # Ctrl-C as a terminal delivers it. A suite run as a background job of a script
            # (CI, nohup, `make ... &`) inherits SIGINT ignored, and so would the command:
            # it then redraws on and on after the signal.
            preexec_fn=_default_sigint,
        )
        try:
            wait_for(lambda: output.read_text().count("oldest ready") >= 3, "3 frames", 20)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    assert "Traceback" not in output.read_text()


def _ctrl_c_after_first_frame(dsn: str, output: Path, delay: float) -> int:
    """`stats --watch 0.01` interrupted `delay` seconds after its first frame; its exit status.

    From the first frame on: an interrupt during the interpreter's own start-up is Python's
    business, not the command's.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_FARM_")}
    with output.open("w") as sink:
        proc = subprocess.Popen(
            [CLI, "stats", "--dsn", dsn, *NO_FARM, "--watch", "0.01"],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_default_sigint,  # as in the test above
        )
        try:
            wait_for(lambda: "oldest ready" in output.read_text(), "a first frame", 20)
            time.sleep(delay)  # a random moment of the redraw loop, on purpose
            proc.send_signal(signal.SIGINT)
            return proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@pytest.mark.one_server
@pytest.mark.slow
def test_stats_watch_exits_cleanly_on_ctrl_c_at_any_moment(
    dsn: str, conn: Conn, tmp_path: Path
) -> None:
    # At a 10 ms refresh most of the time is spent in a query, so some of these interrupts
    # land while the server is still answering: the connection is busy then, and nothing may
    # send it another command on the way out.
    publish(conn, 1, queue="orders")
    for attempt in range(20):
        output = tmp_path / f"watch-{attempt}.txt"
        delay = random.uniform(0.05, 0.5)
        code = _ctrl_c_after_first_frame(dsn, output, delay)
        text = output.read_text()
        assert code == 0, f"run {attempt}, Ctrl-C after {delay:.3f}s:\n{text[-2000:]}"
        assert "Traceback" not in text, f"run {attempt}, Ctrl-C after {delay:.3f}s"


@pytest.mark.slow
def test_stats_reads_the_rates_of_a_running_farm(tmp_path: Path, dsn: str, conn: Conn) -> None:
    (tmp_path / "farmapp.py").write_text(FARMAPP)
    # About 160 rows/s (2 processes x 8 handlers x 0.1 s), topped up below 2,000 rows: the farm
    # acks all through every window `stats` measures, however long the command takes to start
    # on a busy machine. (At full speed it drained 5,000 rows in about two seconds, before a
    # slow start's first scrape: a rate of 0.)
    with farm_process(tmp_path, dsn, FARMAPP_SLEEP="0.1", FARMAPP_CONCURRENCY="8") as farm:
        wait_for(lambda: farm.healthy(2), "a healthy farm", 30, farm)
        url = f"http://127.0.0.1:{farm.port}/metrics"
        frames: list[Any] = []

        def rates() -> Any:
            (backlog,) = conn.execute("SELECT count(*) FROM outbox").fetchone() or (0,)
            if backlog < 2000:
                publish(conn, 5000, queue="q")
            data = out_json("stats", "--dsn", dsn, "--metrics-url", url)
            frames.append(data["farm"])
            q = data["farm"].get("queues", {}).get("q")
            return q if q and q["acked"] > 0 else None

        try:
            q = wait_for(rates, "an acked rate", 60, farm)
        except pytest.fail.Exception as exc:
            raise pytest.fail.Exception(f"last farm frame {frames[-1:]}: {exc}") from None
        assert q["lag_p99"] is None or q["lag_p99"] >= 0


# -- dlq list / show -------------------------------------------------------------------------


def test_dlq_list_every_filter(dsn: str, conn: Conn) -> None:
    (old,) = fail(conn, 1, queue="mail", age="3 days", reason="max_deliveries")
    (mid,) = fail(conn, 1, queue="orders", age="2 hours", exc="TimeoutError('inventory')")
    (new,) = fail(conn, 1, queue="orders", reason="rejected")

    def listed(*args: str) -> list[int]:
        return [r["id"] for r in out_json("dlq", "list", "--dsn", dsn, *args)]

    assert listed() == [new, mid, old]
    assert listed("--queue", "orders") == [new, mid]
    assert listed("--reason", "max_deliveries") == [old]
    assert listed("--since", "1d") == [new, mid]
    assert listed("--until", "1h") == [mid, old]
    assert listed("--grep", "inventory") == [mid]
    assert listed("--limit", "1") == [new]
    text = run("dlq", "list", "--dsn", dsn, "--queue", "mail")
    assert "max_deliveries" in text.stdout
    assert "KeyError('sku')" in text.stdout


def test_a_bad_duration_is_a_usage_error(dsn: str) -> None:
    result = run("dlq", "list", "--dsn", dsn, "--since", "soon")
    assert result.returncode == 2
    assert "neither a duration ago" in result.stderr


def test_dlq_show(dsn: str, conn: Conn) -> None:
    (row_id,) = fail(conn, 1, exc="KeyError('sku')\nTraceback (innermost frames last):\n  f.py")
    data = out_json("dlq", "show", str(row_id), "--dsn", dsn)
    assert data["payload"] == {"encoding": "json", "value": {"n": 1}}
    assert data["headers"] == {"content-type": "application/json"}
    text = run("dlq", "show", str(row_id), "--dsn", dsn)
    assert "payload (json, 8 bytes):" in text.stdout
    assert "Traceback (innermost frames last):" in text.stdout
    missing = run("dlq", "show", "999999", "--dsn", dsn)
    assert missing.returncode == 1
    assert "no DLQ row 999999" in missing.stderr


# -- replay / purge --------------------------------------------------------------------------


def test_replay_needs_a_selection(dsn: str) -> None:
    result = run("dlq", "replay", "--dsn", dsn)
    assert result.returncode == 2
    assert "IDs, a filter" in result.stderr


def test_replay_dry_run_says_what_and_changes_nothing(dsn: str, conn: Conn) -> None:
    fail(conn, 3)
    text = run(
        "dlq", "replay", "--dsn", dsn, "--all", "--to-queue", "v2", "--delay", "5m", "--dry-run"
    )
    assert text.returncode == 0, text.stderr
    assert (
        "would replay 3 row(s) from outbox_dlq into outbox (queue v2, due in 300s)" in text.stdout
    )
    assert "dry run: nothing was changed" in text.stdout
    data = out_json("dlq", "replay", "--dsn", dsn, "--queue", "orders", "--dry-run")
    assert (data["dry_run"], data["matched"], data["replayed"]) == (True, 3, 0)
    assert data["groups"][0]["rows"] == 3
    assert counts(conn) == (0, 3)


def test_replay_of_several_rows_asks_first(dsn: str, conn: Conn) -> None:
    fail(conn, 2)
    refused = subprocess.run(
        [CLI, "dlq", "replay", "--dsn", dsn, "--all"],
        input="n\n",
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert refused.returncode == 1
    assert "Replay 2 rows?" in refused.stderr
    assert counts(conn) == (0, 2)
    agreed = subprocess.run(
        [CLI, "dlq", "replay", "--dsn", dsn, "--all"],
        input="y\n",
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert agreed.returncode == 0, agreed.stderr
    assert "replayed 2 row(s) into outbox in 1 batch(es)" in agreed.stdout
    assert counts(conn) == (2, 0)


def test_replay_by_id_needs_no_confirmation(dsn: str, conn: Conn) -> None:
    first, _ = fail(conn, 2)
    data = out_json("dlq", "replay", str(first), "--dsn", dsn)
    assert data == {"dry_run": False, "replayed": 1, "batches": 1, "notified": 1}
    headers = conn.execute("SELECT headers FROM outbox").fetchone()
    assert headers is not None
    assert headers[0]["replayed_from"] == first


def test_purge_older_than_on_the_database_clock(dsn: str, conn: Conn) -> None:
    fail(conn, 3, age="91 days")
    keep = fail(conn, 2, age="89 days")
    dry = out_json("dlq", "purge", "--dsn", dsn, "--older-than", "90d", "--dry-run")
    assert dry["matched"] == 3
    done = out_json("dlq", "purge", "--dsn", dsn, "--older-than", "90d", "--yes")
    assert done["purged"] == 3
    assert [r["id"] for r in out_json("dlq", "list", "--dsn", dsn)] == keep[::-1]
    both = run("dlq", "purge", "--dsn", dsn, "--older-than", "1d", "--until", "2d")
    assert both.returncode == 2


@pytest.mark.slow
def others_connected(conn: Conn) -> int:
    """Backends on this test's database other than `conn`'s own."""
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_replay_killed_in_the_middle_loses_and_repeats_nothing(dsn: str, conn: Conn) -> None:
    total = 100_000
    fail(conn, total)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_FARM_")}
    command = [CLI, "dlq", "replay", "--dsn", dsn, "--all", "--yes", "--batch", "500"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        wait_for(lambda: counts(conn)[0] >= total // 4, "a quarter replayed", 60, every=0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    # The killed client's last COMMIT may have reached the server before its socket closed:
    # count once its backend has ended, so that batch is either in the counts or never was.
    wait_for(lambda: not others_connected(conn), "the killed replay's backend gone", 30)
    moved, left = counts(conn)
    assert 0 < moved < total, "the kill came after the end: nothing was tested"
    assert moved + left == total
    again = run("dlq", "replay", "--dsn", dsn, "--all", "--yes", "--batch", "500", timeout=120)
    assert again.returncode == 0, again.stderr
    assert f"replayed {left} row(s)" in again.stdout
    row = conn.execute(
        "SELECT count(*), count(DISTINCT headers->>'replayed_from'), count(DISTINCT payload) "
        "FROM outbox"
    ).fetchone()
    assert row == (total, total, total)
    assert counts(conn) == (total, 0)


# -- doctor ----------------------------------------------------------------------------------


def test_doctor_json_and_exit_status(dsn: str) -> None:
    data = out_json("doctor", "--dsn", dsn)
    assert data["ok"] is True
    assert {"connection", "schema", "xmin horizon"} <= {c["name"] for c in data["checks"]}
    text = run("doctor", "--dsn", dsn)
    assert text.returncode == 0
    assert text.stdout.startswith("OK   connection: database ")


def test_doctor_fails_on_a_held_back_xmin(dsn: str) -> None:
    with psycopg.connect(dsn) as other:
        other.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        other.execute("SELECT 1")
        time.sleep(1.2)  # the snapshot outlives the 1 s limit: time passes on purpose
        result = run("doctor", "--dsn", dsn, "--max-xmin-age", "1s")
    assert result.returncode == 1
    assert "FAIL xmin horizon: oldest holder: session pid" in result.stdout


def test_doctor_reports_an_unreachable_server_as_a_failure() -> None:
    result = run("doctor", "--dsn", "host=127.0.0.1 port=1 user=postgres password=secret")
    assert result.returncode == 1
    assert result.stdout.startswith("FAIL connection: cannot connect")
    assert "secret" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    "command",
    [["stats"], ["doctor"], ["dlq", "list"], ["dlq", "show"], ["dlq", "replay"], ["dlq", "purge"]],
)
def test_every_option_says_what_it_does(command: list[str]) -> None:
    import click

    from outbox_farm.cli import main

    found: Any = main
    for name in command:
        found = found.commands[name]
    for param in found.params:
        if isinstance(param, click.Option):
            assert param.help, f"{' '.join(command)} {param.opts[0]} has no help text"
