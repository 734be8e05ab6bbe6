"""A missing secret and a malformed one, as an operator meets them: the real `outbox-farm`
command and the real relay targets, against a real Postgres and real brokers.

- An empty DSN (a variable whose secret did not load, `--dsn ""`) is an error naming where it
  came from; a command runs on the embedded server only with `--embedded`, naming it and its
  data directory, and saying when it created it.
- No message shows any fragment of a password, whatever libpq or a client library quoted
  after our redaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from outbox_farm.relay.base import TargetUnavailable
from outbox_farm.relay.nats import NatsJetStream
from outbox_farm.relay.rabbitmq import RabbitMQ
from outbox_farm.relay.redis_streams import RedisStream
from tests.acceptance.test_cli import run
from tests.acceptance.test_farm import FARMAPP
from tests.integration.brokers import AMQP, REDIS, require
from tests.steps import wait_for

FRAGMENTS = ("Sup3r", "S3cretPW", "ssS3cretPW")
# The three shapes of the issue: libpq quotes the first two in its parse error, and reads the
# third's password up to its first `@`, reporting the rest as the host.
BAD_DSNS = {
    "percent": "postgresql://u:Sup3r%S3cretPW@127.0.0.1/db",
    "blank": "host=127.0.0.1 password=Sup3r S3cretPW dbname=db",
    "at-sign": "postgresql://u:p@ssS3cretPW@127.0.0.1/db",
}
COMMANDS = {
    "migrate": ["migrate"],
    "check": ["check"],
    "start": ["start", "farmapp:farm", "--procs", "1", "--metrics-bind", ""],
    "stats": ["stats", "--metrics-url", ""],
    "dlq list": ["dlq", "list"],
    "doctor": ["doctor"],
}
CONFIGURATION_ERROR = 1  # what each command exits with for a DSN it cannot use
USAGE_ERROR = 2


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    """A working directory holding the app `start` imports, and nothing else."""
    (tmp_path / "farmapp.py").write_text(FARMAPP)
    return tmp_path


def shows_no_secret(result: subprocess.CompletedProcess[str]) -> None:
    output = result.stdout + result.stderr
    for fragment in FRAGMENTS:
        assert fragment not in output, output
    assert "Traceback" not in output, output


# -- no secret in any message --------------------------------------------------------------------


@pytest.mark.parametrize("shape", BAD_DSNS)
@pytest.mark.parametrize("command", COMMANDS)
def test_no_command_shows_the_password_of_a_bad_dsn_in_the_environment(
    command: str, shape: str, app_dir: Path
) -> None:
    result = run(*COMMANDS[command], cwd=str(app_dir), OUTBOX_FARM_DSN=BAD_DSNS[shape])
    shows_no_secret(result)
    assert result.returncode == CONFIGURATION_ERROR, result.stdout + result.stderr
    assert "***" in result.stdout + result.stderr


@pytest.mark.parametrize("shape", BAD_DSNS)
@pytest.mark.parametrize("command", ["check", "start"])
def test_no_command_shows_the_password_of_a_bad_dsn_in_a_file_or_option(
    command: str, shape: str, app_dir: Path
) -> None:
    secret = app_dir / "dsn"
    secret.write_text(BAD_DSNS[shape] + "\n")
    from_file = run(*COMMANDS[command], "--dsn-file", str(secret), cwd=str(app_dir))
    from_option = run(*COMMANDS[command], "--dsn", BAD_DSNS[shape], cwd=str(app_dir))
    for result in (from_file, from_option):
        shows_no_secret(result)
        assert result.returncode == CONFIGURATION_ERROR, result.stderr


# -- an empty DSN is an error, never the embedded server -----------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_an_empty_dsn_variable_is_refused_naming_it(command: str, app_dir: Path) -> None:
    result = run(*COMMANDS[command], cwd=str(app_dir), OUTBOX_FARM_DSN="")
    assert result.returncode == USAGE_ERROR, result.stdout + result.stderr
    assert "OUTBOX_FARM_DSN is set but empty" in result.stderr
    assert "--dsn-file" in result.stderr
    assert "the embedded server is not used in its place" in result.stderr
    assert not (app_dir / ".outbox-farm").exists()


@pytest.mark.parametrize("value", ["", "  "])
@pytest.mark.parametrize("command", ["migrate", "start", "doctor"])
def test_an_empty_dsn_option_is_refused_naming_it(command: str, value: str, app_dir: Path) -> None:
    result = run(*COMMANDS[command], "--dsn", value, cwd=str(app_dir))
    assert result.returncode == USAGE_ERROR, result.stdout + result.stderr
    assert "'--dsn' is empty" in result.stderr
    assert not (app_dir / ".outbox-farm").exists()


def test_an_empty_dsn_file_variable_is_refused_naming_it(app_dir: Path) -> None:
    result = run("check", cwd=str(app_dir), OUTBOX_FARM_DSN_FILE="")
    assert result.returncode == USAGE_ERROR, result.stderr
    assert "OUTBOX_FARM_DSN_FILE is set but empty" in result.stderr
    assert not (app_dir / ".outbox-farm").exists()


def test_start_without_a_dsn_refuses_and_lists_every_way_to_give_one(app_dir: Path) -> None:
    result = run(*COMMANDS["start"], cwd=str(app_dir))
    assert result.returncode == USAGE_ERROR, result.stdout + result.stderr
    for way in ("--dsn", "OUTBOX_FARM_DSN", "--dsn-file", "--embedded"):
        assert way in result.stderr
    assert not (app_dir / ".outbox-farm").exists()


def test_start_refuses_embedded_and_a_dsn_together(app_dir: Path, dsn: str) -> None:
    result = run(*COMMANDS["start"], "--embedded", cwd=str(app_dir), OUTBOX_FARM_DSN=dsn)
    assert result.returncode == USAGE_ERROR, result.stdout + result.stderr
    assert "--embedded and a DSN" in result.stderr


@pytest.mark.slow
def test_the_embedded_server_names_its_data_directory_and_says_it_created_it(
    app_dir: Path,
) -> None:
    data = app_dir / ".outbox-farm" / "pgdata"
    first = run("migrate", "--embedded", cwd=str(app_dir), timeout=120)
    assert first.returncode == 0, first.stderr
    assert f"using the embedded PostgreSQL server at {data} (created)" in first.stderr
    again = run("check", cwd=str(app_dir), timeout=120, OUTBOX_FARM_EMBEDDED="1")
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"using the embedded PostgreSQL server at {data} (existing)" in again.stderr


# -- relay targets -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded_nats() -> Iterator[str]:
    """A NATS server of this test's own that requires a user and password (the shared one
    lets anyone in, so a wrong password could not fail there); its address as host:port."""
    binary = shutil.which("nats-server")
    if binary is None:
        pytest.skip("nats-server is not installed")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [binary, "-a", "127.0.0.1", "-p", str(port), "--user", "u", "--pass", "right"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _listening(port, proc)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _listening(port: int, proc: subprocess.Popen[bytes]) -> None:
    """Return once `port` accepts a connection; fail if `proc` exits or time runs out."""

    def accepts() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"nats-server exited with status {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return True
        return False

    wait_for(accepts, f"nats-server listening on port {port}", 30, every=0.05)


def _wrong_secrets(scheme: str, user: str, where: str) -> list[str]:
    return [
        f"{scheme}://{user}:Sup3r%S3cretPW@{where}",
        f"{scheme}://{user}:Sup3r S3cretPW@{where}",
        f"{scheme}://{user}:p@ssS3cretPW@{where}",
    ]


def _refusal(target: Any) -> str:
    """The text of the error `target` raises when asked to connect (it must raise)."""

    async def attempt() -> str:
        try:
            await target.connect()
        except TargetUnavailable as exc:
            return str(exc)
        finally:
            await target.close()
        pytest.fail(f"{target!r} connected with a wrong password")

    return asyncio.run(attempt())


def _where(url: str) -> str:
    return url.rsplit("@", 1)[-1].split("://")[-1]


@pytest.mark.parametrize("shape", range(3))
def test_rabbitmq_errors_show_no_password(shape: int) -> None:
    url = _wrong_secrets("amqp", "guest", _where(require(AMQP)))[shape]
    target = RabbitMQ(url)
    text = _refusal(target)
    for fragment in FRAGMENTS:
        assert fragment not in text
        assert fragment not in repr(target)
    assert "***" in text


@pytest.mark.parametrize("shape", range(3))
def test_redis_errors_show_no_password(shape: int) -> None:
    url = _wrong_secrets("redis", "nobody", _where(require(REDIS)))[shape]
    target = RedisStream(url)
    text = _refusal(target)
    for fragment in FRAGMENTS:
        assert fragment not in text
        assert fragment not in repr(target)
    assert "***" in text


# nats-py leaves the socket of a refused CONNECT open; collected here, it is this test's.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("shape", range(3))
def test_nats_errors_show_no_password(shape: int, guarded_nats: str) -> None:
    url = _wrong_secrets("nats", "u", guarded_nats)[shape]
    target = NatsJetStream(url)
    text = _refusal(target)
    gc.collect()
    for fragment in FRAGMENTS:
        assert fragment not in text
        assert fragment not in repr(target)
    assert "***" in text
