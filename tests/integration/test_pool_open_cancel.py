"""A stop that arrives while the runtime's pool is still opening (a worker told to stop during
its boot, the database slow to answer) must leave no connection attempt behind: psycopg_pool
retries a failed attempt for ever in a task of its own, and a task that outlives the stop keeps
the worker's event loop, and so the worker, from ending."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pytest

from outbox_farm.db.connect import CONNECT_TIMEOUT
from outbox_farm.db.pool import open_pool


@pytest.fixture
def silent_server() -> Iterator[tuple[str, threading.Event]]:
    """A TCP server that accepts connections and never says a word: a connection attempt to it
    waits for the server's first message until its timeout. Yields its DSN and an event set at
    the first accepted connection."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted = threading.Event()
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)
            accepted.set()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    port = listener.getsockname()[1]
    try:
        yield f"host=127.0.0.1 port={port} user=nobody dbname=nothing", accepted
    finally:
        listener.close()
        for conn in held:
            conn.close()
        thread.join(5)


def test_a_pool_cancelled_while_opening_lets_its_event_loop_end(
    silent_server: tuple[str, threading.Event],
) -> None:
    """The loop ends once the pool's attempt times out (at most the connect timeout), instead
    of the attempt being retried for ever. Run in a thread of its own so that a regression
    fails this test instead of hanging the suite."""
    dsn, accepted = silent_server
    outcome: list[BaseException | None] = []

    async def scenario() -> None:
        opening = asyncio.create_task(open_pool(dsn, 4))
        await asyncio.get_running_loop().run_in_executor(None, accepted.wait, 30)
        assert accepted.is_set(), "the pool never tried to connect"
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening

    def run() -> None:
        try:
            asyncio.run(scenario())  # returns once every task of the loop has ended
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(CONNECT_TIMEOUT + 20)
    assert not thread.is_alive(), "the cancelled pool's connection attempts never ended"
    assert outcome == [None]
