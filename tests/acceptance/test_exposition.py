"""/metrics and /healthz served by their own process, forked here from the test process standing
in for the arbiter: idle and trickling clients starve nobody, a corrupt metric file is a 500 and
not a dead server, a stale health snapshot is a 503 naming the arbiter, and a public bind says so.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import os
import select
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import psutil
import psycopg
import pytest

from loadtests.chaos.outage import FakeClock, faketime_missing
from outbox_farm.prefork import exposition as exposition_module
from outbox_farm.prefork.exposition import REQUEST_DEADLINE, Exposition
from tests.acceptance.test_farm import FARMAPP, RunningFarm, farm_process
from tests.steps import publish, wait_for

IDLE_CLIENTS = 50
LATENCY_LIMIT = 0.1  # seconds /healthz may take, whatever the other clients do
KILLS = 5  # SIGKILLs of the server process in a row


def get(address: str, path: str) -> tuple[int, bytes, float]:
    """(status, body, seconds from connecting to the last byte of the body)."""
    host, _, port = address.rpartition(":")
    started = time.monotonic()
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", path)
        reply = conn.getresponse()
        body = reply.read()
    finally:
        conn.close()
    return reply.status, body, time.monotonic() - started


def health(address: str) -> tuple[int, dict[str, Any]]:
    status, body, _ = get(address, "/healthz")
    return status, orjson.loads(body)


def alive(pid: int) -> bool:
    """Whether `pid`, a child of this process, still runs (without reaping it)."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def metrics_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The multiprocess directory the server process renders /metrics from."""
    folder = tmp_path / "metrics"
    folder.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(folder))
    return folder


@pytest.fixture
def server_log(tmp_path: Path) -> Iterator[Path]:
    """Where the server process' log lines go: it inherits this handler when it forks."""
    path = tmp_path / "server.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("outbox_farm.exposition")
    logger.addHandler(handler)
    yield path
    logger.removeHandler(handler)
    handler.close()


@pytest.fixture
def exposition(tmp_path: Path, metrics_dir: Path, server_log: Path) -> Iterator[Exposition]:
    """An Exposition on a free loopback port, its server process started."""
    served = Exposition("127.0.0.1:0", tmp_path)
    served.start()
    yield served
    served.close()


class Slowloris(threading.Thread):
    """A client sending its request head one byte every half second, until the server cuts it
    off (`cut_after`: seconds from connecting) or `stop` is set."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.connected = time.monotonic()
        self.cut_after: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        head = b"GET /healthz HTTP/1.1\r\nX-Padding: " + b"a" * 1000
        with self.sock:
            for byte in head:
                # Readable means the server closed the connection: EOF (or a reset).
                if select.select([self.sock], [], [], 0.5)[0] or self.stop.is_set():
                    break
                try:
                    self.sock.send(bytes([byte]))
                except OSError:
                    break
            if not self.stop.is_set():
                self.cut_after = time.monotonic() - self.connected


def test_idle_and_trickling_clients_do_not_delay_healthz(exposition: Exposition) -> None:
    exposition.publish(True, {"procs": 1, "alive": 1})
    baseline = [get(exposition.address, "/healthz")[2] for _ in range(5)]

    host, _, port = exposition.address.rpartition(":")
    idle = [socket.create_connection((host, int(port)), timeout=30) for _ in range(IDLE_CLIENTS)]
    slowloris = Slowloris(exposition.address)
    slowloris.start()
    try:
        assert exposition.pid is not None
        server = psutil.Process(exposition.pid)
        # Every idle client accepted and holding a thread of the server: the load is real.
        wait_for(lambda: server.num_threads() > IDLE_CLIENTS + 1, "idle clients accepted", 30)
        loaded = []
        for _ in range(5):
            status, body, seconds = get(exposition.address, "/healthz")
            assert (status, orjson.loads(body)) == (200, {"procs": 1, "alive": 1})
            loaded.append(seconds)
        # Positive control: the idle clients were still connected while we measured.
        assert not select.select(idle, [], [], 0)[0], "idle clients were cut before the measure"
        assert slowloris.is_alive()
        print(  # shown with -s: the measure behind the limit
            f"/healthz: {max(baseline) * 1000:.1f} ms alone, {max(loaded) * 1000:.1f} ms with "
            f"{IDLE_CLIENTS} idle clients and a slowloris"
        )
        assert max(loaded) <= LATENCY_LIMIT, (baseline, loaded)

        # The deadline frees their threads: every idle client and the slowloris are cut off.
        for sock in idle:
            sock.settimeout(REQUEST_DEADLINE + 30)
            assert sock.recv(1) == b""
        slowloris.join(REQUEST_DEADLINE + 30)
        assert slowloris.cut_after is not None
        assert REQUEST_DEADLINE <= slowloris.cut_after < REQUEST_DEADLINE + 30
    finally:
        slowloris.stop.set()
        for sock in idle:
            sock.close()


def _corrupt_metric_file(path: Path) -> None:
    """A multiprocess metric file whose one entry's key is not UTF-8 (prometheus_client's
    layout: used bytes, padding, then length-prefixed keys padded to 8, then two doubles)."""
    key = b"\xff\xfe" * 4
    entry = struct.pack("i", len(key)) + key + b"\0" * 4 + struct.pack("dd", 1.0, 0.0)
    data = struct.pack("i", 8 + len(entry)) + b"\0" * 4 + entry
    path.write_bytes(data.ljust(4096, b"\0"))


def test_a_corrupt_metric_file_is_a_500_and_the_server_lives_on(
    exposition: Exposition, metrics_dir: Path, server_log: Path
) -> None:
    exposition.publish(True, {"procs": 1})
    status, _, _ = get(exposition.address, "/metrics")
    assert status == 200  # positive control: the same server renders a sound directory

    _corrupt_metric_file(metrics_dir / "counter_999999.db")
    status, body, _ = get(exposition.address, "/metrics")
    assert status == 500
    assert body.startswith(b"/metrics failed: UnicodeDecodeError: ")
    assert body.count(b"\n") == 1
    log = server_log.read_text()
    assert "answering /metrics failed" in log
    assert "Traceback" in log
    assert "UnicodeDecodeError" in log

    assert exposition.pid is not None
    assert alive(exposition.pid)
    assert health(exposition.address) == (200, {"procs": 1})


def test_healthz_is_503_naming_the_arbiter_when_its_snapshot_goes_stale(
    tmp_path: Path, metrics_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The forked server process inherits the shortened limit.
    monkeypatch.setattr(exposition_module, "STALE_AFTER", 1.0)
    served = Exposition("127.0.0.1:0", tmp_path)
    served.start()
    try:
        status, detail = health(served.address)
        assert status == 503
        assert detail["starting"] is True

        served.publish(True, {"procs": 2, "alive": 2})
        assert health(served.address) == (200, {"procs": 2, "alive": 2})

        def stale() -> dict[str, Any] | None:
            status, detail = health(served.address)
            return detail if status == 503 else None

        detail = wait_for(stale, "/healthz 503 once the snapshot is stale", 30)
        assert detail["alive"] == 2
        assert any(p.startswith("arbiter not responding for ") for p in detail["problems"])

        served.publish(True, {"procs": 2, "alive": 2})
        assert health(served.address)[0] == 200
    finally:
        served.close()


def test_a_public_bind_logs_a_warning_and_loopback_does_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="outbox_farm.exposition")
    Exposition("127.0.0.1:0", tmp_path).close()
    assert not caplog.records

    public = Exposition("0.0.0.0:0", tmp_path)
    public.close()
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert f"public on {public.address}" in record.getMessage()
    assert "--metrics-bind" in record.getMessage()


def test_sigterm_stops_the_server_cleanly_and_close_tolerates_it_reaped(
    exposition: Exposition,
) -> None:
    pid = exposition.pid
    assert pid is not None
    assert health(exposition.address)[0] == 503  # serving: nothing published yet
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    exposition.close()  # reaped already, as by the arbiter's reap loop
    assert exposition.pid is None


def test_the_server_stops_when_the_arbiter_is_gone(tmp_path: Path, metrics_dir: Path) -> None:
    """An arbiter killed outright leaves no server behind holding the port."""
    read, write = os.pipe()
    arbiter = os.fork()
    if arbiter == 0:  # the stand-in arbiter: starts the server, reports its pid, waits for KILL
        try:
            os.close(read)
            served = Exposition("127.0.0.1:0", tmp_path)
            os.write(write, f"{served.start()} {served.address}\n".encode())
            time.sleep(600)  # until the test kills it: no condition to wait for
        finally:
            os._exit(1)
    os.close(write)
    with os.fdopen(read) as reply:
        pid, address = reply.readline().split()
    assert health(address)[0] == 503  # positive control: it serves while the arbiter lives
    os.kill(arbiter, signal.SIGKILL)
    os.waitpid(arbiter, 0)
    wait_for(lambda: not alive(int(pid)), f"server {pid} gone after its arbiter", 30)


# -- the server process under a real farm -------------------------------------------------------


def metrics_server(farm: RunningFarm) -> int | None:
    """The arbiter's child listening on the farm's /metrics port, if one runs."""
    try:
        children = psutil.Process(farm.pid).children()
    except psutil.NoSuchProcess:
        return None
    for child in children:
        with contextlib.suppress(psutil.Error):
            if child.status() != psutil.STATUS_ZOMBIE and any(
                c.status == psutil.CONN_LISTEN and c.laddr.port == farm.port
                for c in child.net_connections(kind="tcp")
            ):
                return child.pid
    return None


def acked(farm: RunningFarm) -> float:
    return farm.metric("outbox_farm_acked_total", queue="q") or 0.0


@pytest.mark.slow
@pytest.mark.parametrize("step", [None, "-2h"], ids=["steady-clock", "clock-stepped-back"])
def test_a_killed_server_process_is_replaced_and_serves_the_same_counters(
    tmp_path: Path, dsn: str, conn: psycopg.Connection[Any], step: str | None
) -> None:
    """The /metrics server process SIGKILLed 5 times in a row (also with the wall clock stepped
    2 h back): each time the arbiter starts another on the same port, which answers /healthz 200
    and /metrics with every counter the workers counted before, and those after."""
    (tmp_path / "farmapp.py").write_text(FARMAPP)
    clock_env: dict[str, str] = {}
    if step is not None:
        missing = faketime_missing()
        if missing:
            pytest.skip(missing)
        clock = FakeClock(tmp_path / "clock")
        clock_env = clock.env()
    with farm_process(tmp_path, dsn, **clock_env) as farm:
        wait_for(lambda: farm.healthy(2), "2 healthy workers", 60, farm)
        publish(conn, 100, queue="q")
        wait_for(lambda: acked(farm) >= 100, "100 rows acked", 30, farm)
        if step is not None:
            clock.set(step)
        for kill in range(1, KILLS + 1):
            server = wait_for(
                lambda: metrics_server(farm), f"server process before kill {kill}", 30, farm
            )
            os.kill(server, signal.SIGKILL)
            wait_for(
                lambda server=server: metrics_server(farm) not in (None, server),
                f"new server process after kill {kill}",
                30,
                farm,
            )
        wait_for(lambda: farm.healthy(2), "/healthz 200 after the kills", 30, farm)
        assert acked(farm) >= 100, farm.get("/metrics")
        publish(conn, 100, queue="q")
        wait_for(lambda: acked(farm) >= 200, "200 rows acked after the kills", 30, farm)
        code, _ = farm.stop()
    assert code == 0, farm.log_tail()
