"""A fake farm for the console's tests: an HTTP server on loopback that answers as told,
including not at all (one byte every so often, for ever) or far too much."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator

Answer = Callable[[socket.socket, threading.Event], None]


def trickle(every: float) -> Answer:
    """A status line that never ends: one byte every `every` seconds until the test ends."""

    def answer(conn: socket.socket, stop: threading.Event) -> None:
        for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"x" * 100_000:
            if stop.wait(every):
                return
            try:
                conn.sendall(bytes([byte]))
            except OSError:  # the client gave up: what the test wants
                return

    return answer


def body(status: int, content: bytes, kind: str = "text/plain") -> Answer:
    def answer(conn: socket.socket, stop: threading.Event) -> None:
        head = (
            f"HTTP/1.1 {status} X\r\nContent-Type: {kind}\r\nContent-Length: {len(content)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        with contextlib.suppress(OSError):
            conn.sendall(head + content)

    return answer


def raw(data: bytes) -> Answer:
    def answer(conn: socket.socket, stop: threading.Event) -> None:
        with contextlib.suppress(OSError):
            conn.sendall(data)

    return answer


@contextlib.contextmanager
def fake_farm(answers: dict[str, Answer]) -> Iterator[str]:
    """A server answering GET <path> with `answers[path]`; yields its /metrics URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def handle(conn: socket.socket) -> None:
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                request += chunk
            path = request.split(b" ")[1].decode()
            answers.get(path, body(404, b"no"))(conn, stop)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=handle, args=(conn,), daemon=True)
            thread.start()
            threads.append(thread)

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/metrics"
    finally:
        stop.set()
        listener.close()
        for thread in threads:
            thread.join(timeout=5)
