"""Every connection the farm opens carries libpq's TCP liveness settings (keepalives and
`tcp_user_timeout`), so a host that goes silent costs seconds, not the kernel's minutes of
retransmissions; a DSN's own values win. Checked on the connections themselves, as libpq
holds them: the pool's, the LISTEN session's, a command's, the arbiter's bounded one."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from outbox_farm.db.connect import TCP_LIVENESS, bounded, connect, liveness
from outbox_farm.db.listen import listen
from outbox_farm.db.pool import open_pool
from outbox_farm.errors import ConnectionLost


def settings(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> dict[str, str]:
    """The connection's libpq options among TCP_LIVENESS's keywords, as libpq holds them."""
    return {
        option.keyword.decode(): (option.val or b"").decode()
        for option in conn.pgconn.info
        if option.keyword.decode() in TCP_LIVENESS
    }


def test_a_commands_connection_and_the_bounded_one_carry_the_settings(dsn: str) -> None:
    with connect(dsn, autocommit=True) as conn:
        assert settings(conn) == TCP_LIVENESS
    with bounded(dsn, 5) as conn:
        assert settings(conn) == TCP_LIVENESS


def test_the_pools_and_the_listen_sessions_connections_carry_them(dsn: str) -> None:
    async def read() -> tuple[dict[str, str], dict[str, str]]:
        pool = await open_pool(dsn, 2)
        try:
            async with pool.connection() as conn:
                pooled = settings(conn)
        finally:
            await pool.close()
        async with listen(dsn, "outbox_outbox") as session:
            listening = settings(session._conn)
        return pooled, listening

    pooled, listening = asyncio.run(read())
    assert pooled == TCP_LIVENESS
    assert listening == TCP_LIVENESS


def test_a_dsns_own_values_win(dsn: str) -> None:
    own = make_conninfo(dsn, tcp_user_timeout=5000, keepalives_idle=3)
    assert liveness(own) == {
        key: value
        for key, value in TCP_LIVENESS.items()
        if key not in ("tcp_user_timeout", "keepalives_idle")
    }
    with connect(own, autocommit=True) as conn:
        assert settings(conn) == {
            **TCP_LIVENESS,
            "tcp_user_timeout": "5000",
            "keepalives_idle": "3",
        }


def test_a_dsn_libpq_cannot_parse_still_fails_with_the_drivers_words() -> None:
    assert liveness("not a dsn ===") == {}
    with pytest.raises(ConnectionLost, match="cannot connect"):
        connect("not a dsn ===")
