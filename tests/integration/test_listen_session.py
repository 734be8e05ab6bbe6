"""The LISTEN session read by its socket's reader (`db.listen`), against a real Postgres: every
NOTIFY handed on in order, none lost to the driver's reads, a session that ends noticed at
once, and a callback's error ending the relay without leaving the reader behind."""

from __future__ import annotations

import asyncio
import select
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest

from outbox_farm.db.listen import Listening, listen
from outbox_farm.errors import ConnectionLost

CHANNEL = "outbox_outbox"
Scenario = Callable[[Listening], Awaitable[Any]]


def _in_session(dsn: str, scenario: Scenario) -> Any:
    async def main() -> Any:
        async with listen(dsn, CHANNEL) as session:
            return await scenario(session)

    return asyncio.run(main())


def _notify(conn: psycopg.Connection[Any], *payloads: str) -> None:
    with conn.transaction():
        for payload in payloads:
            conn.execute("SELECT pg_notify(%s, %s)", [CHANNEL, payload])


async def _relay_until(session: Listening, got: list[str], count: int) -> None:
    """Relay until `count` payloads came (each relay ends with its health check)."""
    async with asyncio.timeout(30):
        while len(got) < count:
            await session.relay(got.append, 0.05)


def test_a_burst_of_notifies_arrives_whole_and_in_order(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    payloads = [f"q{i}" for i in range(500)]

    async def scenario(session: Listening) -> list[str]:
        got: list[str] = []
        for start in range(0, len(payloads), 100):  # five transactions, a hundred each
            _notify(conn, *payloads[start : start + 100])
        await _relay_until(session, got, len(payloads))
        return got

    assert _in_session(dsn, scenario) == payloads


def test_a_notify_the_driver_read_with_a_statement_is_relayed_next(dsn: str) -> None:
    """A NOTIFY the session sends itself arrives with its own statement's result, read by the
    driver, not by the reader: it is kept and handed on by the next relay."""

    async def scenario(session: Listening) -> list[str]:
        got: list[str] = []
        await session._conn.execute("SELECT pg_notify(%s, 'own')", [CHANNEL])
        await _relay_until(session, got, 1)
        return got

    assert _in_session(dsn, scenario) == ["own"]


def test_a_notify_already_read_off_the_socket_is_relayed_at_once(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A NOTIFY whose bytes the driver already took off the socket (the socket no longer says
    readable for them) is handed on as the relay starts, not after its wait."""

    async def scenario(session: Listening) -> list[str]:
        _notify(conn, "buffered")
        pgconn = session._conn.pgconn
        readable, _, _ = select.select([pgconn.socket], [], [], 10)
        assert readable, "the NOTIFY never reached the session's socket"
        pgconn.consume_input()  # into the driver's buffer, not yet handed on
        got: list[str] = []
        arrived = asyncio.Event()

        def note(payload: str) -> None:
            got.append(payload)
            arrived.set()

        relay = asyncio.create_task(session.relay(note, 3600))
        try:
            async with asyncio.timeout(10):
                await arrived.wait()
        finally:
            relay.cancel()
            await asyncio.gather(relay, return_exceptions=True)
        return got

    assert _in_session(dsn, scenario) == ["buffered"]


def test_a_terminated_session_is_noticed_before_the_relay_ends(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """The socket says the session ended: the relay raises at once, not after its wait."""

    async def scenario(session: Listening) -> None:
        relay = asyncio.create_task(session.relay(lambda _: None, 3600))
        await asyncio.sleep(0)  # the reader is in place
        pid = session._conn.info.backend_pid
        conn.execute("SELECT pg_terminate_backend(%s, 5000)", [pid])
        async with asyncio.timeout(30):
            with pytest.raises(ConnectionLost):
                await relay

    _in_session(dsn, scenario)


def test_an_error_of_the_callback_ends_the_relay_and_the_next_relay_works(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    class Refused(Exception):
        pass

    def refuse(payload: str) -> None:
        raise Refused(payload)

    async def scenario(session: Listening) -> list[str]:
        _notify(conn, "first")
        with pytest.raises(Refused, match="first"):
            async with asyncio.timeout(30):
                await session.relay(refuse, 3600)
        got: list[str] = []
        _notify(conn, "second")
        await _relay_until(session, got, 1)
        return got

    assert _in_session(dsn, scenario) == ["second"]


def test_a_cancelled_relay_leaves_the_session_usable(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A stop mid-wait: the reader goes with it, and the connection answers statements."""

    async def scenario(session: Listening) -> list[str]:
        relay = asyncio.create_task(session.relay(lambda _: None, 3600))
        await asyncio.sleep(0)
        relay.cancel()
        with pytest.raises(asyncio.CancelledError):
            await relay
        got: list[str] = []
        _notify(conn, "after")
        await _relay_until(session, got, 1)
        return got

    assert _in_session(dsn, scenario) == ["after"]
