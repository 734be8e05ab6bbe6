"""Farms on one database that run different code for one queue: each process reports its
handlers' fingerprints (`chores.farm_code`), expiring on the database clock; the housekeeper
warns once when two codes for a queue outlast the grace period, and `doctor` shows it."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from outbox_farm import Farm, Message
from outbox_farm.admin.doctor import Status, doctor
from outbox_farm.chores.farm_code import GRACE, CodeWatch, fingerprint
from outbox_farm.names import TableNames
from outbox_farm.ops.migrate import migrate
from outbox_farm.ops.privileges import check_privileges
from outbox_farm.settings import RuntimeSettings
from outbox_farm.worker.runtime import Runtime
from tests.integration.test_vacuum import pool_for
from tests.steps import eventually

NAMES = TableNames.build("outbox", "outbox_dlq")


def farm_with(version: str) -> Farm:
    """A farm whose handler of queue `q` is one of two codes."""
    farm = Farm(dlq_table="outbox_dlq")
    if version == "old":

        @farm.handler("q")
        async def handle(message: Message) -> None:
            pass

    else:

        @farm.handler("q")
        async def handle(message: Message) -> None:  # the new code
            message.json()

    return farm


def watch(farm: Farm, pool: AsyncConnectionPool[Any], worker: str, compare: bool) -> CodeWatch:
    code = CodeWatch(pool, farm.queries, list(farm.handlers.values()), compare=compare)
    code.worker = worker  # two farms in one test process
    return code


def test_the_fingerprint_follows_the_code_and_the_row_policy_not_the_concurrency() -> None:
    old, new = farm_with("old").handlers["q"], farm_with("new").handlers["q"]
    assert fingerprint(old) == fingerprint(farm_with("old").handlers["q"])
    assert fingerprint(old) != fingerprint(new)
    farm = Farm()

    @farm.handler("q", concurrency=2)
    async def handle(message: Message) -> None:
        pass

    busier = Farm()
    busier.handler("q", concurrency=64)(handle)
    assert fingerprint(farm.handlers["q"]) == fingerprint(busier.handlers["q"])
    patient = Farm()
    patient.handler("q", concurrency=2, max_deliveries=3)(handle)
    assert fingerprint(farm.handlers["q"]) != fingerprint(patient.handlers["q"])


def test_two_codes_for_a_queue_warn_once_past_the_grace_and_clear_when_they_agree(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        async with pool_for(dsn) as pool:
            old = watch(farm_with("old"), pool, "host-a pid 1", compare=True)
            new = watch(farm_with("new"), pool, "host-b pid 2", compare=False)
            await old.once()
            await new.once()
            await old.once()
            assert old.warnings == []  # two codes, but a deploy may be rolling: within grace
            await old.once(grace=0.0)
            await old.once(grace=0.0)
            assert len(old.warnings) == 1, old.warnings
            assert old.warnings[0].startswith(
                "queue q: the farms on this database run different code for it, for "
            )
            assert "in 1 process(es) (host-a pid 1)" in old.warnings[0]
            assert "in 1 process(es) (host-b pid 2)" in old.warnings[0]
            assert new.warnings == []  # only the comparing process says so

            fixed = watch(farm_with("old"), pool, "host-b pid 2", compare=False)
            await fixed.once()
            await old.once(grace=0.0)
            assert old.warnings == []

    with caplog.at_level(logging.INFO, logger="outbox_farm.farm_code"):
        asyncio.run(scenario())
    events = [getattr(r, "event", None) for r in caplog.records]
    assert events == ["code_disagrees", "code_agrees"], events
    assert caplog.records[0].levelno == logging.WARNING


def test_a_stopped_farm_stops_counting_when_its_report_expires(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    async def scenario() -> None:
        async with pool_for(dsn) as pool:
            old = watch(farm_with("old"), pool, "host-a pid 1", compare=True)
            new = watch(farm_with("new"), pool, "host-b pid 2", compare=False)
            await new.once()
            await old.once(grace=0.0)
            assert len(old.warnings) == 1
            # host-b stopped: its report runs out (on the database clock) and is removed.
            conn.execute(
                "UPDATE outbox_farm_code SET expires_at = now() - interval '1 second' "
                "WHERE worker = 'host-b pid 2'"
            )
            await old.once(grace=0.0)
            assert old.warnings == []
        workers = conn.execute("SELECT worker FROM outbox_farm_code").fetchall()
        assert workers == [("host-a pid 1",)]

    asyncio.run(scenario())


def test_doctor_warns_of_two_codes_past_the_grace(dsn: str, conn: psycopg.Connection[Any]) -> None:
    async def report(version: str, worker: str) -> None:
        async with pool_for(dsn) as pool:
            await watch(farm_with(version), pool, worker, compare=False).once()

    def farm_code_check() -> Any:
        (check,) = [c for c in doctor(conn, NAMES) if c.name == "farm code"]
        return check

    assert farm_code_check().status is Status.OK
    asyncio.run(report("old", "host-a pid 1"))
    asyncio.run(report("new", "host-b pid 2"))
    young = farm_code_check()
    assert young.status is Status.OK
    assert "changing code" in young.detail
    conn.execute(f"UPDATE outbox_farm_code SET since = now() - interval '{GRACE + 5} seconds'")
    lasting = farm_code_check()
    assert lasting.status is Status.WARN
    assert "queue q: the farms on this database run different code for it" in lasting.detail
    assert "finish the deploy" in lasting.hint


def test_a_database_without_the_table_costs_the_comparison_only_until_it_is_migrated(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Code deployed before its schema: said once, and tried again, so that the `migrate` the
    line asks for takes effect without a restart."""
    conn.execute("DROP TABLE outbox_farm_code")

    def reports() -> list[tuple[Any, ...]]:
        return conn.execute("SELECT worker FROM outbox_farm_code").fetchall()

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "outbox_farm.farm_code"]

    async def scenario() -> None:
        async with pool_for(dsn) as pool:
            code = watch(farm_with("old"), pool, "host-a pid 1", compare=True)
            task = asyncio.create_task(code.run(every=0.01, retry=0.05))
            try:
                await eventually(said, "the line saying the code cannot be compared")
                assert code.warnings == []
                (check,) = [c for c in doctor(conn, NAMES) if c.name == "farm code"]
                assert check.status is Status.WARN
                assert "migration 0010" in check.hint
                assert check_privileges(conn, NAMES).notes == [
                    "the farms cannot tell when they run different code: outbox_farm_code does "
                    "not exist; run `outbox-farm migrate` (with --repair if its migration, 0010, "
                    "was applied and the table dropped since)"
                ]
                migrate(conn, NAMES, repair=True)
                assert await eventually(reports, "the report made after the migration") == [
                    ("host-a pid 1",)
                ]
            finally:
                await code.forget(task)

    with caplog.at_level(logging.INFO, logger="outbox_farm.farm_code"):
        asyncio.run(scenario())
    first, again = said()  # tried many times, said once
    assert "the farms' code cannot be compared" in first
    assert "outbox-farm migrate" in first
    assert again == "the farms' code is compared again"
    assert check_privileges(conn, NAMES).notes == []


def test_two_processes_of_one_host_name_and_pid_keep_their_own_reports(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Containers sharing a host name, each with its own pids: here two watches of one process."""

    def workers() -> list[str]:
        rows = conn.execute("SELECT worker FROM outbox_farm_code").fetchall()
        return [worker for (worker,) in rows]

    async def scenario() -> None:
        async with pool_for(dsn) as pool:
            old, new = (
                CodeWatch(pool, farm.queries, list(farm.handlers.values()), compare=compare)
                for farm, compare in ((farm_with("old"), True), (farm_with("new"), False))
            )
            assert old.worker.startswith(f"{socket.gethostname()} pid {os.getpid()} #")
            await new.once()
            await old.once(grace=0.0)
            assert sorted(workers()) == sorted([old.worker, new.worker])
            assert len(old.warnings) == 1, old.warnings
            assert f"in 1 process(es) ({new.worker})" in old.warnings[0]

            await new.forget(asyncio.create_task(new.run()))  # it stops; the other's stays
            assert workers() == [old.worker]

    asyncio.run(scenario())


def test_a_runtime_reports_its_code_with_its_note_and_withdraws_it_at_the_stop(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    farm = farm_with("old")

    def reports() -> list[tuple[Any, ...]]:
        return conn.execute("SELECT queue, fingerprint, note FROM outbox_farm_code").fetchall()

    async def scenario() -> None:
        runtime = Runtime(
            list(farm.handlers.values()),
            farm.queries,
            dsn,
            RuntimeSettings(listen=False),
            code_note=lambda: "the last reload failed",
        )
        await runtime.start()
        try:
            await eventually(reports, "the runtime's report")
            assert reports() == [("q", fingerprint(farm.handlers["q"]), "the last reload failed")]
        finally:
            await runtime.stop()
        assert reports() == []

    asyncio.run(scenario())
