"""`/metrics` and `/healthz`, answered from the arbiter's own select loop.

No thread and no event loop: the arbiter must hold neither when it forks. Each request is
read and answered synchronously with a short socket timeout; scrapes are rare and small.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import orjson

MAX_REQUEST = 8192
REQUEST_DEADLINE = 1.0  # seconds for a whole request, however it trickles in


def listen(bind: str) -> socket.socket:
    host, _, port = bind.rpartition(":")
    sock = socket.create_server((host or "127.0.0.1", int(port)), reuse_port=False)
    sock.setblocking(False)
    return sock


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


def serve_one(
    listener: socket.socket, health: Callable[[], tuple[bool, dict[str, object]]]
) -> None:
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
