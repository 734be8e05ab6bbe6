"""The operator's controls of each queue (`outbox_farm_queues`, migration 0011), as the farms
read them, and the NOTIFY that makes every farm read them again at once.

The NOTIFY goes on the farm's own channel, not a second one: every farm already LISTENs there
(one connection, reconnected and health-checked by the listener, which reloads the controls on
each reconnect), and a channel derived from the farm's could pass Postgres's 63-byte limit that
`names` already holds the farm's channel to. Its payload is `storage.CONTROL_PREFIX` followed by the
queue. The channel's other payloads are queue names, so a listener tells the two apart by the
prefix; and were a queue ever named so, the cost is one spurious reload or one spurious wake of
a fetcher that finds nothing new, never a missed one.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import psycopg
from psycopg import sql

from ..names import TableNames
from ..queries import load_blocks
from ..storage import CONTROL_PREFIX


@cache
def _changed_statement(channel: str) -> str:
    block = load_blocks()["control_changed"]
    return sql.SQL(block).format(notify_channel=sql.Literal(channel)).as_string(None)


def notify_changed(conn: psycopg.Connection[Any], names: TableNames, queue: str) -> None:
    """Tell every farm on `names`' outbox that `queue`'s controls changed: they reload them
    once the caller's transaction commits."""
    conn.execute(_changed_statement(names.channel), {"payload": CONTROL_PREFIX + queue})
