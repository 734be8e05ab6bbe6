"""The fetcher in a stream of messages, against a real Postgres: a claim that took rows waits a
moment (`fetcher.LOOK_AGAIN`) for the next NOTIFY before it asks when the next row is due, so
the claim that NOTIFY wakes is not held behind that query's round trip; and a row published to
become due later, in the middle of the stream, is still run when it is due."""

from __future__ import annotations

import asyncio
import threading
import time

import psycopg
import pytest

from outbox_farm import Farm, Message
from outbox_farm.worker import fetcher
from tests.steps import eventually, publish

ROWS = 50  # each published when the claim before it has taken rows
LATE_BY = 2.0  # seconds past its due time a delayed row may start, on a busy machine


def stream(dsn: str, rows: int | None, stop: threading.Event | None = None) -> list[int]:
    """Publish `rows` rows (or until `stop`), each its own transaction and NOTIFY, back to
    back on one connection; their ids."""
    published: list[int] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        while (rows is None or len(published) < rows) and not (stop and stop.is_set()):
            published.extend(publish(conn, 1, queue="q"))
    return published


def test_claims_in_a_stream_do_not_each_wait_for_the_next_due_query(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each row is published by the claim before it, once that claim has its rows, so its
    NOTIFY is always on its way when the fetcher looks for one. The look is made long and
    the look for stranded rows rare, so that a busy machine cannot decide the count: with
    the look, only the start and the end of the stream ask for the next due time; without
    it, every claim would."""
    monkeypatch.setattr(fetcher, "LOOK_AGAIN", 10.0)
    monkeypatch.setattr(fetcher, "STRANDED_EVERY", 3600.0)
    farm = Farm()
    handled: set[int] = set()
    published: list[int] = []
    counts = {"claims": 0, "next_due": 0}

    @farm.handler("q", concurrency=8)
    async def handle(msg: Message) -> None:
        handled.add(msg.id)

    async def run() -> None:
        async with (
            await psycopg.AsyncConnection.connect(dsn, autocommit=True) as producer,
            farm.running(dsn) as runtime,
        ):
            store = runtime.store
            assert store is not None
            assert runtime.listener is not None
            claim, next_due = store.claim, store.next_due

            async def publish_next() -> None:
                published.append(await farm.apublish(producer, b"", queue="q"))

            async def counted_claim(*args: object) -> list[Message]:
                counts["claims"] += 1
                rows = await claim(*args)  # type: ignore[arg-type]
                if rows and len(published) < ROWS:
                    await publish_next()
                return rows

            async def counted_next_due(*args: object) -> float | None:
                counts["next_due"] += 1
                return await next_due(*args)  # type: ignore[arg-type]

            store.claim = counted_claim  # type: ignore[method-assign,assignment]
            store.next_due = counted_next_due  # type: ignore[method-assign,assignment]
            await runtime.listener.connected.wait()
            await publish_next()
            await eventually(lambda: len(published) == ROWS, "the stream published")
            await eventually(lambda: handled >= set(published), "every row handled")

    asyncio.run(run())
    assert counts["claims"] >= ROWS, counts
    # The first short claim looks for stranded rows with the query; the last finds no NOTIFY.
    assert counts["next_due"] <= 3, counts


def test_a_row_due_later_published_in_a_stream_runs_when_due(dsn: str) -> None:
    farm = Farm()
    started: dict[int, float] = {}
    stop = threading.Event()

    @farm.handler("q", concurrency=8)
    async def handle(msg: Message) -> None:
        started[msg.id] = time.monotonic()

    async def run() -> tuple[float, float]:
        async with farm.running(dsn) as runtime:
            assert runtime.listener is not None
            await runtime.listener.connected.wait()
            streaming = asyncio.create_task(asyncio.to_thread(stream, dsn, None, stop))
            try:
                await eventually(lambda: len(started) >= 20, "the stream under way")
                with psycopg.connect(dsn, autocommit=True) as conn:
                    due = time.monotonic() + 0.5
                    (delayed,) = publish(conn, [b"later"], queue="q", activate_in=0.5)
            finally:
                stop.set()
                await streaming
            await eventually(lambda: delayed in started, "the delayed row run")
            return started[delayed], due

    ran, due = asyncio.run(run())
    assert due <= ran + 0.05  # not before it was due (the clocks differ by a hair)
    assert ran - due <= LATE_BY, ran - due
