"""The operator's controls of a queue reach every farm on Postgres: at once by the NOTIFY a
change sends, within a second by the poll when no NOTIFY comes, before the first claim of a
farm that starts; and a database without the controls table pauses nothing, says so once, and
is read again until it has one."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AsyncExitStack
from pathlib import Path

import psycopg
import pytest

from outbox_farm import Farm, Message
from outbox_farm.db.control import notify_changed
from outbox_farm.names import TableNames
from outbox_farm.storage import is_control
from outbox_farm.worker import control
from outbox_farm.worker.runtime import Runtime
from tests.steps import eventually

NAMES = TableNames.build("outbox", "outbox_dlq")
MIGRATION = Path(__file__).parents[2] / "migrations" / "0011_queue_control.sql"


def test_a_change_notifies_the_farms_channel_once_its_transaction_commits(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as listening:
        listening.execute(f"LISTEN {NAMES.channel}")
        with psycopg.connect(dsn) as conn:
            notify_changed(conn, NAMES, "emails")
            conn.rollback()
            notify_changed(conn, NAMES, "emails")
        payloads = [n.payload for n in listening.notifies(timeout=2.0, stop_after=1)]
    assert len(payloads) == 1
    assert is_control(payloads[0])
    assert payloads[0].endswith("emails")
    assert not is_control("emails")


def pause(dsn: str, queue: str, paused: bool = True, *, notify: bool = True) -> None:
    """What `outbox-farm queue pause|resume` does: the row, and the NOTIFY, in one transaction."""
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO outbox_farm_queues (target, queue, paused, reason) VALUES (%s, %s, %s,"
            " 'test') ON CONFLICT (target, queue) DO UPDATE SET paused = excluded.paused",
            [str(NAMES.outbox), queue, paused],
        )
        if notify:
            notify_changed(conn, NAMES, queue)


def publish(dsn: str, queue: str) -> None:
    farm = Farm(dlq_table="outbox_dlq")
    with psycopg.connect(dsn) as conn:
        farm.publish(conn, {"q": queue}, queue=queue)


def farm_of(ran: list[str]) -> Farm:
    farm = Farm(dlq_table="outbox_dlq")

    @farm.handler("emails")
    async def emails(msg: Message) -> None:
        ran.append("emails")

    return farm


def held(runtime: Runtime) -> bool:
    return runtime.fetchers["emails"].held_by is not None


async def held_within(runtimes: list[Runtime], seconds: float, want: bool = True) -> float:
    started = time.monotonic()
    await eventually(lambda: all(held(r) is want for r in runtimes), "the change reaching all")
    took = time.monotonic() - started
    assert took < seconds
    return took


def test_every_farm_stops_claiming_at_the_notify_and_claims_again_on_resume(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(control, "POLL", 3600.0)  # only the NOTIFY can bring the change
    ran: list[str] = []

    async def scenario() -> None:
        async with AsyncExitStack() as stack:
            runtimes = [
                await stack.enter_async_context(farm_of(ran).running(dsn, poll_interval=0.05))
                for _ in range(2)
            ]
            await eventually(
                lambda: all(r.listener and r.listener.connected.is_set() for r in runtimes),
                "both listening",
            )
            await asyncio.to_thread(pause, dsn, "emails")
            await held_within(runtimes, 1.0)
            await asyncio.to_thread(publish, dsn, "emails")
            await asyncio.to_thread(pause, dsn, "emails", False)
            await held_within(runtimes, 1.0, want=False)
            await eventually(lambda: ran == ["emails"], "the row's run after the resume")

    asyncio.run(scenario())


def test_without_a_listener_the_poll_brings_a_change_within_a_second(dsn: str) -> None:
    async def scenario() -> None:
        async with farm_of([]).running(dsn, listen=False) as runtime:
            assert runtime.listener is None
            await asyncio.to_thread(pause, dsn, "emails", notify=False)
            await held_within([runtime], 1.5)

    asyncio.run(scenario())


def test_a_farm_started_while_its_queue_is_paused_holds_it_from_its_start(dsn: str) -> None:
    pause(dsn, "emails")

    async def scenario() -> None:
        async with farm_of([]).running(dsn) as runtime:
            assert held(runtime)
            assert list(runtime.paused) == ["emails"]

    asyncio.run(scenario())


def test_without_the_controls_table_nothing_is_paused_until_it_is_migrated(
    dsn: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(control, "POLL", 0.05)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE outbox_farm_queues")
    ran: list[str] = []

    async def scenario() -> None:
        async with farm_of(ran).running(dsn, poll_interval=0.05) as runtime:
            await asyncio.to_thread(publish, dsn, "emails")
            await eventually(lambda: ran == ["emails"], "the row's run")
            missing = [r for r in caplog.records if getattr(r, "event", "") == "controls_missing"]
            assert len(missing) == 1
            assert "outbox-farm migrate" in missing[0].getMessage()
            await asyncio.to_thread(migrate_and_pause, dsn)
            await held_within([runtime], 5.0)

    with caplog.at_level(logging.WARNING, "outbox_farm.control"):
        asyncio.run(scenario())


def migrate_and_pause(dsn: str) -> None:
    """Create the table as its migration does (the migrations table still lists it)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(MIGRATION.read_text(encoding="utf-8").encode())
    pause(dsn, "emails", notify=False)
