"""A hand-over that comes back after the stop began: its rows are released at once, not left
in an inbox nobody reads any more (their leases would hold them for `lease_ttl`)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from outbox_farm.db.store import PostgresStore
from outbox_farm.handler import HandlerSpec
from outbox_farm.message import Message
from outbox_farm.names import TableNames
from outbox_farm.observe import observers
from outbox_farm.queries import Queries
from outbox_farm.worker.completer import Completer
from outbox_farm.worker.fetcher import Fetcher
from outbox_farm.worker.inbox import Inbox


def test_rows_handed_over_after_the_stop_began_are_released(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    row = conn.execute(
        "INSERT INTO outbox (queue, payload, ordering_key) VALUES ('handed_late', 'x', 'k')"
        " RETURNING id"
    ).fetchone()
    assert row is not None

    async def scenario() -> Inbox[Message | None]:
        queries = Queries(TableNames.build("outbox", "outbox_dlq"))
        inbox: Inbox[Message | None] = Inbox()
        spec = HandlerSpec(queue="handed_late", func=lambda msg: None)
        async with AsyncConnectionPool(dsn, kwargs={"autocommit": True}, open=False) as pool:
            store = PostgresStore(pool, queries)
            fetcher = Fetcher(spec, store, inbox, observers(), Completer(store))
            handover = fetcher.handover()
            claim = dataclasses.replace(handover, limit=1)  # what the ack would have taken
            msgs = await store.claim(claim)
            assert [msg.id for msg in msgs] == [row[0]]
            await fetcher.stop()  # never started: the stop only marks it stopping
            await fetcher.handed(handover, msgs, 0.001)
            assert len(fetcher.ledger) == 0
        return inbox

    inbox = asyncio.run(scenario())
    assert inbox.empty()
    assert conn.execute(
        "SELECT acquired_token, deliveries_count FROM outbox WHERE id = %s", [row[0]]
    ).fetchone() == (None, 0)
