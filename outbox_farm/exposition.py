"""`/metrics` and `/healthz`, answered from the arbiter's own select loop.

No thread and no event loop: the arbiter must hold neither when it forks. Each request is
read and answered synchronously with a short socket timeout; scrapes are rare and small.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from collections.abc import Callable

import orjson

from .errors import ConfigurationError

DEFAULT_BIND = "127.0.0.1:9464"
MAX_REQUEST = 8192
REQUEST_DEADLINE = 1.0  # seconds for a whole request, however it trickles in
# /healthz: (healthy, the JSON body's fields).
Health = Callable[[], tuple[bool, dict[str, object]]]
_EXAMPLE = "e.g. 127.0.0.1:9464, [::1]:9464, or empty to turn /metrics and /healthz off"


def parse_bind(bind: str) -> tuple[str, int]:
    """`host:port` as `socket.create_server` takes it; refused with the reason otherwise.

    An IPv6 host goes in brackets; an empty host (`:9464`) is loopback, never every interface:
    /metrics says how busy the farm is and should not face the network by accident. The host
    is resolved only when binding.
    """
    host, colon, port = bind.strip().rpartition(":")
    if not colon or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ConfigurationError(
            f"{bind!r} is not host:port with a port from 0 to 65535 ({_EXAMPLE})"
        )
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ConfigurationError(f"{bind!r}: put an IPv6 address in brackets ({_EXAMPLE})")
    return host or "127.0.0.1", int(port)


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
        socket.getaddrinfo(*address, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigurationError(
            f"--metrics-bind {bind}: cannot resolve {address[0]!r} ({exc.strerror}); {elsewhere}"
        ) from None
    try:
        sock = socket.create_server(address, reuse_port=False)
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


class Endpoint:
    """The listening socket of /metrics and /healthz, and the arbiter's answer to /healthz.

    Selectable (`fileno`), so the arbiter waits on it in its own select loop and answers one
    request each time it is readable; a forked worker closes its copy.
    """

    def __init__(self, bind: str, health: Health) -> None:
        self.socket = listen(bind)
        self.health = health

    def fileno(self) -> int:
        return self.socket.fileno()

    @property
    def address(self) -> str:
        host, port = self.socket.getsockname()[:2]
        return f"{host}:{port}"

    def answer(self) -> None:
        serve_one(self.socket, self.health)

    def close(self) -> None:
        self.socket.close()


def render_metrics() -> bytes:
    """All processes' metrics merged, from a fresh registry per scrape."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    return generate_latest(registry)


def _response(status: str, body: bytes, content_type: str) -> bytes:
    head = (
        f"HTTP/1.0 {status}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def serve_one(listener: socket.socket, health: Health) -> None:
    """Accept and answer one pending request, if any."""
    try:
        conn, _ = listener.accept()
    except (BlockingIOError, InterruptedError):
        return
    with conn:
        deadline = time.monotonic() + REQUEST_DEADLINE
        try:
            request = b""
            while b"\r\n\r\n" not in request and len(request) < MAX_REQUEST:
                left = deadline - time.monotonic()
                if left <= 0:
                    return  # a slow client must not stall the arbiter's loop
                conn.settimeout(left)
                chunk = conn.recv(4096)
                if not chunk:
                    break
                request += chunk
            parts = request.split(b" ", 2)
            path = parts[1].split(b"?")[0] if len(parts) > 1 else b""
            if path == b"/metrics":
                reply = _response("200 OK", render_metrics(), "text/plain; version=0.0.4")
            elif path == b"/healthz":
                ok, detail = health()
                reply = _response(
                    "200 OK" if ok else "503 Service Unavailable",
                    orjson.dumps(detail),
                    "application/json",
                )
            else:
                reply = _response("404 Not Found", b"try /metrics or /healthz\n", "text/plain")
            conn.sendall(reply)
        except OSError:
            pass
