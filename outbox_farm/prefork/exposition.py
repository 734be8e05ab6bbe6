"""`/metrics`, `/healthz` and `/livez`, served by a process of their own nobody can starve.

The arbiter may hold no thread when it forks its workers, and its loop must never wait on an
HTTP client, so it does not serve HTTP itself: it binds the socket (configuration errors surface
at start, in its own process), forks a server process that serves it, and on every loop turn
publishes its health to a snapshot file that the server reads. The server is the standard
library's threading HTTP server, one thread per connection, each connection held to a
deadline: idle or trickling clients cost a thread for a few seconds and never delay anyone
else. Whatever goes wrong while rendering answers 500 and is logged; the server process never
dies of a scrape, and if it dies anyway the arbiter forks another.

The snapshot carries the arbiter's CLOCK_MONOTONIC reading (system-wide, so comparable across
processes, and blind to wall-clock steps): a snapshot that stops being refreshed means the
arbiter's loop is stuck, and /healthz says so rather than repeating its last good answer.

/livez answers for the arbiter alone, for a liveness probe: 200 while the arbiter lives and its
loop turns (a fresh snapshot), 503 otherwise, whatever its workers or the database do. /healthz
is 503 through a database outage, which the farm waits out and a restart would not cure; /livez
stays 200 then, so a probe on it can be tight without restarting pods that are fine.
"""

from __future__ import annotations

import errno
import io
import ipaddress
import logging
import os
import signal
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NoReturn, cast

import orjson

from ..errors import ConfigurationError
from ..settings import parse_bind

log = logging.getLogger("outbox_farm.exposition")
# Seconds a connection may take to send its request head, and then to take the reply: an idle
# or trickling client holds one thread for that long, and nobody else waits on it.
REQUEST_DEADLINE = 5.0
# The arbiter publishes at least once a second; a snapshot older than this means its loop is stuck.
STALE_AFTER = 10.0
STOP_TIMEOUT = 2.0  # seconds the server process gets to exit on SIGTERM before SIGKILL
RESTART_EVERY = 1.0  # seconds between two starts of the server process, at least
ORPHAN_CHECK = 0.5  # seconds between the server process' checks that the arbiter lives
SNAPSHOT = "health.json"


def listen(bind: str) -> socket.socket:
    """The non-blocking listening socket for /metrics and /healthz.

    Every way this can fail is a configuration error the operator fixes in --metrics-bind (a
    supervisor restarting the farm would only fail again), so each says what to change.
    """
    try:
        address = parse_bind(bind)
    except ConfigurationError as exc:
        raise ConfigurationError(f"--metrics-bind {exc}") from None
    elsewhere = "use an address of this machine (127.0.0.1, 0.0.0.0, or one of its interfaces)"
    try:
        found = socket.getaddrinfo(*address, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigurationError(
            f"--metrics-bind {bind}: cannot resolve {address[0]!r} ({exc.strerror}); {elsewhere}"
        ) from None
    try:
        # The family the address resolved to: create_server binds IPv4 unless told otherwise.
        sock = socket.create_server(address, family=found[0][0], reuse_port=False)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            advice = (
                "something else (another outbox-farm?) is listening there: pick a free port, "
                "or an empty --metrics-bind to turn /metrics off"
            )
        elif exc.errno == errno.EACCES:
            advice = "binding it needs privileges this process lacks: use a port above 1023"
        else:
            advice = elsewhere
        # create_server appends the address to strerror; the message names it already.
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ConfigurationError(
            f"--metrics-bind {bind}: cannot listen ({reason}); {advice}"
        ) from None
    sock.setblocking(False)
    return sock


class Exposition:
    """/metrics, /healthz and /livez on `bind`, served by a process forked from the arbiter.

    Used by the arbiter alone, in this order: construct (binds at once: a bad --metrics-bind is
    a ConfigurationError before anything runs), `start`, `publish` on every loop turn (which
    starts the server again when `died` said it must, at most once every RESTART_EVERY
    seconds), `died` when the arbiter reaped `pid`, `close_in_worker` in each freshly forked
    worker, `close` when the arbiter exits. The snapshot file lives in `state_dir`, the
    arbiter's directory of per-run files.
    """

    def __init__(self, bind: str, state_dir: Path) -> None:
        self.socket = listen(bind)
        self.snapshot = state_dir / SNAPSHOT
        # An earlier arbiter's snapshot (one killed outright leaves it) would answer for this one.
        self.snapshot.unlink(missing_ok=True)
        self.pid: int | None = None
        self.due: float | None = None  # monotonic time to start the server again, once dead
        self._started = 0.0
        host, port = self.socket.getsockname()[:2]
        # As bound (the system picks the port for port 0), written as --metrics-bind takes it.
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if not ipaddress.ip_address(host).is_loopback:
            log.warning(
                "/metrics and /healthz are public on %s: anyone who reaches this address sees "
                "how busy the farm is; bind them to 127.0.0.1 (or ::1) with --metrics-bind, or "
                "firewall the port",
                self.address,
                extra={"event": "metrics_public", "metrics_bind": self.address},
            )

    def start(self) -> int:
        """Fork the server process; its pid (also kept in `pid`)."""
        self.due, self._started = None, time.monotonic()
        # The arbiter's handlers (TERM, INT, QUIT, HUP, TTIN, TTOU, CHLD), read from the process
        # rather than imported from the arbiter's side, which sits above this module.
        handled = {sig for sig in signal.valid_signals() if callable(signal.getsignal(sig))}
        # Blocked across the fork, as for a worker: a signal reaching the new process before it
        # reset its handlers would run the arbiter's handler in this copy of the arbiter.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, handled)
        pid = os.fork()
        if pid == 0:
            _serve(self.socket, self.snapshot, handled)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        self.pid = pid
        return pid

    def publish(self, healthy: bool, detail: dict[str, object]) -> None:
        """Replace the health snapshot /healthz answers from; atomic, so never read half written."""
        snapshot = {"healthy": healthy, "detail": detail, "published": time.monotonic()}
        partial = self.snapshot.with_name(f".{SNAPSHOT}.{os.getpid()}")
        partial.write_bytes(orjson.dumps(snapshot))
        os.replace(partial, self.snapshot)
        if self.due is not None and time.monotonic() >= self.due:
            self.start()

    def died(self, how: str) -> None:
        """The server process was reaped (`how` it ended): start another on a later turn."""
        self.pid = None
        self.due = max(time.monotonic(), self._started + RESTART_EVERY)
        log.error(
            "the /metrics and /healthz server died (%s); starting another (a traceback above, "
            "if any, says why; a signal means something outside the farm killed it)",
            how,
            extra={"event": "exposition_died"},
        )

    def close_in_worker(self) -> None:
        """In a freshly forked worker: close its copy of the listening socket, nothing more (the
        server process and the snapshot are the arbiter's)."""
        self.socket.close()

    def close(self) -> None:
        """At the arbiter's exit: stop the server process, close the socket, drop the snapshot."""
        if self.pid is not None:
            _stop(self.pid)
            self.pid = None
        self.socket.close()
        self.snapshot.unlink(missing_ok=True)


def _stop(pid: int) -> None:
    """SIGTERM the server process, SIGKILL it after STOP_TIMEOUT, and reap it.

    The pid is signalled only while it is our unreaped child: once the arbiter's own reap loop
    collected it, the number may belong to another process.
    """
    if _reaped(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    while time.monotonic() < deadline:
        time.sleep(0.02)
        if _reaped(pid):
            return
    os.kill(pid, signal.SIGKILL)
    _reaped(pid, 0)


def _reaped(pid: int, flags: int = os.WNOHANG) -> bool:
    try:
        return os.waitpid(pid, flags)[0] != 0
    except ChildProcessError:
        return True  # reaped by the arbiter's loop already


def render_metrics() -> bytes:
    """All processes' metrics merged, from a fresh registry per scrape."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    return generate_latest(registry)


NOT_REPORTED = "the arbiter has not reported its health yet"


def _read_snapshot(snapshot: Path) -> tuple[dict[str, Any], float] | None:
    """The arbiter's latest snapshot and its age in seconds; None while there is none."""
    try:
        published = orjson.loads(snapshot.read_bytes())
    except FileNotFoundError:
        return None
    return published, time.monotonic() - float(published["published"])


def _not_responding(age: float) -> str:
    return f"arbiter not responding for {age:.0f}s"


def render_health(snapshot: Path) -> tuple[int, dict[str, object]]:
    """/healthz's status and body, from the arbiter's latest snapshot and how old it is."""
    read = _read_snapshot(snapshot)
    if read is None:
        return 503, {"starting": True, "problems": [NOT_REPORTED]}
    published, age = read
    detail: dict[str, object] = dict(published["detail"])
    if age > STALE_AFTER:
        problems = cast(list[str], detail.get("problems", []))
        detail["problems"] = [*problems, _not_responding(age)]
        return 503, detail
    return (200 if published["healthy"] else 503), detail


def render_liveness(snapshot: Path, arbiter: int) -> tuple[int, dict[str, object]]:
    """/livez's status and body: 200 while `arbiter` is this process' parent (so alive, and
    still the one that forked it) and its snapshot is fresh. The snapshot's health verdict and
    detail are not read: a database outage or a dead worker is no reason to restart the pod."""
    problems = []
    if os.getppid() != arbiter:
        problems.append(f"arbiter {arbiter} is gone")
    read = _read_snapshot(snapshot)
    if read is None:
        problems.append(NOT_REPORTED)
    elif read[1] > STALE_AFTER:
        problems.append(_not_responding(read[1]))
    if problems:
        return 503, {"arbiter": arbiter, "problems": problems}
    return 200, {"arbiter": arbiter}


class _DeadlineReader(io.RawIOBase):
    """The connection's bytes, each read given only what is left of the request's deadline, so
    a client trickling a byte at a time is cut off as surely as a silent one."""

    def __init__(self, connection: socket.socket, deadline: float) -> None:
        super().__init__()
        self._connection = connection
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request deadline passed")
        self._connection.settimeout(left)
        return self._connection.recv_into(buffer)


class _Handler(BaseHTTPRequestHandler):
    """One connection, one request (HTTP/1.0): the request head within REQUEST_DEADLINE, then
    the reply within REQUEST_DEADLINE."""

    timeout = REQUEST_DEADLINE
    server_version = "outbox-farm"
    sys_version = ""

    def setup(self) -> None:
        super().setup()
        self.rfile.close()
        deadline = time.monotonic() + REQUEST_DEADLINE
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, deadline))

    def do_GET(self) -> None:
        path = self.path.partition("?")[0]
        try:
            if path == "/metrics":
                status, body, kind = 200, render_metrics(), "text/plain; version=0.0.4"
            elif path == "/healthz":
                status, detail = render_health(cast(_Server, self.server).snapshot)
                body, kind = orjson.dumps(detail), "application/json"
            elif path == "/livez":
                server = cast(_Server, self.server)
                status, detail = render_liveness(server.snapshot, server.arbiter)
                body, kind = orjson.dumps(detail), "application/json"
            else:
                status, body, kind = 404, b"try /metrics, /healthz or /livez\n", "text/plain"
        except Exception as exc:
            log.exception("answering %s failed", path, extra={"event": "exposition_failed"})
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())
            status, body, kind = 500, f"{path} failed: {reason}\n".encode(), "text/plain"
        self.connection.settimeout(self.timeout)  # the reply's own deadline, not the request's
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Access lines and client errors (timeouts, bad requests) at DEBUG: a probe per second
        would otherwise fill the log."""
        log.debug("%s " + format, self.address_string(), *args)


class _Server(ThreadingHTTPServer):
    """The stdlib threading server on the arbiter's socket, which outlives any one server
    process; it checks between requests that the arbiter still lives."""

    def __init__(self, sock: socket.socket, snapshot: Path, arbiter: int) -> None:
        super().__init__(sock.getsockname()[:2], _Handler, bind_and_activate=False)
        self.socket.close()  # made by the base class; this server serves the inherited one
        self.socket = sock
        self.snapshot = snapshot
        self.arbiter = arbiter

    def service_actions(self) -> None:
        if os.getppid() != self.arbiter:  # the arbiter died (SIGKILL, OOM): nobody owns us
            log.error("arbiter %d is gone; /metrics server stopping", self.arbiter)
            raise SystemExit(1)

    def handle_error(self, request: object, client_address: object) -> None:
        """A connection's failure ends that connection alone: a client gone mid-reply or too
        slow to take it is routine (DEBUG); anything else is a bug, logged with its traceback."""
        if isinstance(sys.exc_info()[1], OSError):
            log.debug("connection from %s failed", client_address, exc_info=True)
        else:
            log.exception("connection from %s failed", client_address)


def _serve(sock: socket.socket, snapshot: Path, handled: set[signal.Signals]) -> NoReturn:
    """The server process, right after the fork; never returns (os._exit skips the arbiter's
    atexit handlers, which are not this process' to run)."""
    code = 0
    try:
        for sig in handled:
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, _exit_on_term)
        # Ctrl-C reaches the whole process group: the arbiter decides when this server stops,
        # so /healthz keeps answering while the workers drain.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, handled)
        with _Server(sock, snapshot, os.getppid()) as server:
            server.serve_forever(poll_interval=ORPHAN_CHECK)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        log.exception("the /metrics and /healthz server crashed", extra={"event": "crashed"})
        code = 1
    os._exit(code)


def _exit_on_term(signum: int, frame: object) -> None:
    raise SystemExit(0)
