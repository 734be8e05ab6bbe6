"""Privileges found early, and a refused write that stops costing handler runs.

`check_privileges` (so `check`, `start` and `doctor`) tries the farm's writes in a transaction
that is rolled back, so a role whose transactions are read-only, or a write refused by a
trigger, is reported although the catalogs show every grant. A runtime whose acks are refused
for want of a privilege pauses claiming that queue (a /healthz problem) instead of running the
handlers again at every lease, probes the refused write on a clock of its own (not at every
NOTIFY), and resumes on its own once the grant is back. A refused dead-letter move pauses
nothing. A write that could not be tried (a lock, a timeout) is a note, not a refusal.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox_farm import DeadLetter, Farm, Message
from outbox_farm.db import privileges
from outbox_farm.db.store import PostgresStore
from outbox_farm.names import TableNames
from outbox_farm.ops.privileges import check_privileges
from outbox_farm.ops.readiness import check_ready
from outbox_farm.settings import RuntimeSettings
from outbox_farm.worker import pause
from outbox_farm.worker.runtime import Runtime
from tests.acceptance.test_cli import run
from tests.acceptance.test_farm import FARMAPP
from tests.integration.test_privileges import as_role, role
from tests.steps import eventually

NAMES = TableNames.build("outbox", "outbox_dlq")
__all__ = ["role"]  # a fixture, used by name
EVERYTHING = (
    "GRANT SELECT, INSERT, UPDATE, DELETE ON outbox TO {}",
    "GRANT SELECT, INSERT ON outbox_dlq TO {}",
    "GRANT USAGE ON SEQUENCE outbox_id_seq, outbox_dlq_id_seq TO {}",
    "GRANT SELECT ON outbox_farm_migrations TO {}",  # `check` compares what migrate recorded
)


@pytest.fixture
def granted(dsn: str, role: str) -> str:
    """`role` holding every privilege the farm needs; its DSN."""
    with psycopg.connect(dsn, autocommit=True) as owner:
        for grant in EVERYTHING:
            owner.execute(sql.SQL(grant).format(sql.Identifier(role)))
    return as_role(dsn, role)


def test_a_read_only_role_is_told_so_by_check_and_start(
    dsn: str, role: str, granted: str, conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    ident = sql.Identifier(role)
    conn.execute(sql.SQL("ALTER ROLE {} SET default_transaction_read_only = on").format(ident))
    with psycopg.connect(granted, autocommit=True) as as_it:
        report = check_privileges(as_it, NAMES)
    assert len(report.problems) == 1, report.problems
    assert f"the transactions of role {role} are read-only" in report.problems[0]
    assert (
        f'run ALTER ROLE "{role}" SET default_transaction_read_only = off;' in (report.problems[0])
    )
    result = run("check", "--dsn", granted)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "schema OK" not in result.stdout
    assert "are read-only" in result.stdout
    (tmp_path / "farmapp.py").write_text(FARMAPP)
    start = run(
        "start",
        "farmapp:farm",
        *("--dsn", granted, "--procs", "1", "--metrics-bind", ""),
        cwd=str(tmp_path),
        TMPDIR=str(tmp_path),
    )
    assert start.returncode == 1, start.stderr
    assert "the database role lacks privileges the farm needs:" in start.stderr
    assert f"the transactions of role {role} are read-only" in start.stderr

    conn.execute(sql.SQL("ALTER ROLE {} RESET default_transaction_read_only").format(ident))
    with psycopg.connect(granted, autocommit=True) as as_it:
        assert check_privileges(as_it, NAMES).problems == []
    assert run("check", "--dsn", granted).returncode == 0


def test_a_write_refused_despite_the_grants_is_named_and_nothing_is_left_behind(
    granted: str, conn: psycopg.Connection[Any]
) -> None:
    conn.execute(
        "CREATE FUNCTION refuse_delete() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "RAISE insufficient_privilege USING MESSAGE = 'deletes need the archiver'; END $$"
    )
    conn.execute(
        "CREATE TRIGGER refuse_delete BEFORE DELETE ON outbox FOR EACH ROW "
        "EXECUTE FUNCTION refuse_delete()"
    )
    with psycopg.connect(granted, autocommit=True) as as_it:
        report = check_privileges(as_it, NAMES)
    assert len(report.problems) == 1, report.problems
    assert report.problems[0].startswith(
        "DELETE from outbox was refused although the privileges are granted "
        "(deletes need the archiver)"
    )
    assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)  # rolled back
    assert conn.execute("SELECT count(*) FROM outbox_dlq").fetchone() == (0,)

    conn.execute("DROP TRIGGER refuse_delete ON outbox")
    with psycopg.connect(granted, autocommit=True) as as_it:
        assert check_privileges(as_it, NAMES).problems == []


def test_a_table_locked_by_a_migration_is_a_note_and_start_goes_on(
    dsn: str, granted: str, monkeypatch: Any, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(privileges, "LOCK_WAIT", "100ms")  # not the 5 s a migration may take
    untried = "could not be tried: the table is locked (a migration?)"
    # A migration's locks (0009 takes this one on the DLQ), held until its transaction ends.
    with psycopg.connect(dsn) as migration:
        migration.execute("LOCK TABLE outbox_dlq IN SHARE ROW EXCLUSIVE MODE")
        migration.execute("LOCK TABLE outbox IN SHARE MODE")
        with psycopg.connect(granted, autocommit=True) as as_it:
            report = check_privileges(as_it, NAMES)
            with caplog.at_level(logging.WARNING, "test.start"):
                check_ready(as_it, NAMES, False, logging.getLogger("test.start"))  # no raise
    assert report.problems == []
    notes = [note for note in report.notes if untried in note]
    assert notes == [
        f"INSERT into outbox, UPDATE of outbox, DELETE from outbox {untried} (canceling "
        "statement due to lock timeout); not counted as refused: run `outbox-farm check` again "
        "later to try it again",
        f"INSERT into outbox_dlq {untried} (canceling statement due to lock timeout); not counted "
        "as refused: run `outbox-farm check` again later to try it again",
    ]
    logged = [
        r.getMessage() for r in caplog.records if r.__dict__.get("event") == "privileges_note"
    ]
    assert [line for line in logged if untried in line] == notes

    with psycopg.connect(granted, autocommit=True) as as_it:  # the locks are gone: tried, passed
        after = check_privileges(as_it, NAMES)
    assert after.problems == []
    assert not [note for note in after.notes if "could not be tried" in note], after.notes


def test_a_trigger_that_raises_refuses_and_a_cancelled_one_is_a_note(
    granted: str, conn: psycopg.Connection[Any]
) -> None:
    conn.execute(
        "CREATE FUNCTION archive() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "RAISE EXCEPTION 'dead letters go to the archive'; END $$"
    )
    conn.execute(
        "CREATE TRIGGER archive BEFORE INSERT ON outbox_dlq FOR EACH ROW EXECUTE FUNCTION archive()"
    )
    with psycopg.connect(granted, autocommit=True) as as_it:
        report = check_privileges(as_it, NAMES)
    assert len(report.problems) == 1, report.problems
    assert report.problems[0].startswith(
        "INSERT into outbox_dlq was refused although the privileges are granted "
        "(dead letters go to the archive)"
    )

    # A trigger that waits is cancelled by statement_timeout: that says nothing of the role.
    conn.execute(
        "CREATE OR REPLACE FUNCTION archive() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "PERFORM pg_sleep(30); RETURN NEW; END $$"
    )
    with psycopg.connect(granted, autocommit=True, options="-c statement_timeout=200") as as_it:
        report = check_privileges(as_it, NAMES)
    assert report.problems == []
    assert (
        "INSERT into outbox_dlq could not be tried: it was cancelled, by statement_timeout or an "
        "operator (canceling statement due to statement timeout)"
    ) in "\n".join(report.notes)


def test_refused_acks_pause_the_queue_instead_of_running_handlers_every_lease(
    dsn: str, role: str, granted: str, conn: psycopg.Connection[Any], monkeypatch: Any
) -> None:
    ident = sql.Identifier(role)
    conn.execute(sql.SQL("REVOKE DELETE ON outbox FROM {}").format(ident))
    farm = Farm(dlq_table="outbox_dlq")
    runs: list[int] = []
    probes: list[bool] = []

    @farm.handler("q", concurrency=4, lease_ttl=1.0)
    async def handle(message: Message) -> None:
        runs.append(message.id)

    real = PostgresStore.refusal

    async def counted(*args: Any) -> Any:
        error = await real(*args)
        probes.append(error is None)
        return error

    monkeypatch.setattr(PostgresStore, "refusal", counted, raising=False)

    def leases_expired() -> bool:
        row = conn.execute(
            "SELECT count(*) FROM outbox WHERE acquired_at + interval '1 second' < now()"
        ).fetchone()
        return row is not None and row[0] == 5

    async def scenario() -> None:
        settings = RuntimeSettings(poll_interval=0.1, listen=False)
        runtime = Runtime(list(farm.handlers.values()), farm.queries, granted, settings)
        await runtime.start()
        try:
            with psycopg.connect(dsn) as producer:
                farm.publish_batch(producer, [{"n": i} for i in range(5)], queue="q")
            await eventually(lambda: len(runs) == 5, "5 handler runs")
            problem = await eventually(
                lambda: "claims paused" in (runtime.problem or "") and runtime.problem,
                "the queue's claims paused, on /healthz",
            )
            assert "ack write: permission denied for table outbox" in problem
            await eventually(leases_expired, "the 5 leases expired (database clock)")
            probed = len(probes)
            # The fetcher looked twice since (each look a refused probe), and claimed nothing.
            await eventually(lambda: len(probes) >= probed + 2, "2 more probes")
            assert len(runs) == 5, runs
            assert not any(probes), probes
            assert runtime.problems.paused.keys() == {"q"}

            conn.execute(sql.SQL("GRANT DELETE ON outbox TO {}").format(ident))
            await eventually(lambda: any(probes), "a probe that passes")
            await eventually(
                lambda: conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,),
                "every row acked once the grant is back",
            )
            assert sorted(set(runs)) == sorted(runs[:5])  # each row ran again only once
            assert len(runs) == 10, runs
            await eventually(lambda: runtime.problem is None, "no problem any more")
            assert runtime.problems.paused == {}
        finally:
            await runtime.stop()

    asyncio.run(scenario())


def test_a_paused_queue_probes_on_its_clock_whatever_the_notifies(
    dsn: str, role: str, granted: str, conn: psycopg.Connection[Any], monkeypatch: Any
) -> None:
    every = 0.5
    monkeypatch.setattr(pause, "PAUSED_PROBE_EVERY", every)
    conn.execute(sql.SQL("REVOKE DELETE ON outbox FROM {}").format(sql.Identifier(role)))
    farm = Farm(dlq_table="outbox_dlq")

    @farm.handler("q", concurrency=4)
    async def handle(message: Message) -> None:
        pass

    probed: list[float] = []  # when each probe of the refused ack began (monotonic)
    real = PostgresStore.refusal

    async def timed(*args: Any) -> Any:
        probed.append(time.monotonic())
        return await real(*args)

    monkeypatch.setattr(PostgresStore, "refusal", timed, raising=False)

    async def scenario() -> None:
        runtime = Runtime(list(farm.handlers.values()), farm.queries, granted, RuntimeSettings())
        await runtime.start()
        try:
            with psycopg.connect(dsn) as producer:
                farm.publish(producer, {"n": 1}, queue="q")
            await eventually(lambda: runtime.problems.paused, "the queue's claims paused")
            fetcher = runtime.fetchers["q"]
            wakes = 0
            wake = fetcher.wake

            def counted() -> None:
                nonlocal wakes
                wakes += 1
                wake()

            monkeypatch.setattr(fetcher, "wake", counted)
            seen = len(probed)
            channel = farm.queries.names.channel
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as notifier:
                while len(probed) < seen + 4:  # a producer's stream of NOTIFYs, 3 probes long
                    await notifier.execute("SELECT pg_notify(%s, 'q')", [channel])
                    await asyncio.sleep(0.01)  # paces the stream: a NOTIFY every 10 ms
            gaps = [later - earlier for earlier, later in itertools.pairwise(probed)]
            assert min(gaps) >= 0.9 * every, gaps  # each probe waited for its time ...
            assert wakes >= 20  # ... while the NOTIFYs reached the fetcher, many per probe
            assert runtime.problems.paused.keys() == {"q"}

            # The next probe an hour away: a stop still ends the wait at once.
            monkeypatch.setattr(pause, "PAUSED_PROBE_EVERY", 3600.0)
            await eventually(
                lambda: len(probed) > seen + 4, "a probe that set the next an hour off"
            )
            stopping = time.monotonic()
            await runtime.stop(graceful_timeout=60.0)
            assert time.monotonic() - stopping < 20.0  # not the 60 s of the stop's deadline
            assert not fetcher.alive
        finally:
            await runtime.stop()

    asyncio.run(scenario())


def test_a_refused_dead_letter_move_leaves_its_row_and_the_queue_delivering(
    dsn: str, role: str, granted: str, conn: psycopg.Connection[Any]
) -> None:
    ident = sql.Identifier(role)
    conn.execute(sql.SQL("REVOKE INSERT ON outbox_dlq FROM {}").format(ident))
    farm = Farm(dlq_table="outbox_dlq")

    @farm.handler("q", concurrency=4, lease_ttl=1.0)
    async def handle(message: Message) -> None:
        if message.json()["bad"]:
            raise DeadLetter("not ours")

    def left() -> list[int]:
        return [row[0] for row in conn.execute("SELECT id FROM outbox ORDER BY id")]

    async def scenario() -> None:
        settings = RuntimeSettings(poll_interval=0.1)
        runtime = Runtime(list(farm.handlers.values()), farm.queries, granted, settings)
        await runtime.start()
        try:
            with psycopg.connect(dsn) as producer:
                farm.publish(producer, {"bad": True}, queue="q")
            bad = left()
            problem = await eventually(
                lambda: "terminal write" in (runtime.problem or "") and runtime.problem,
                "the refused dead-letter move on /healthz",
            )
            assert "permission denied for table outbox_dlq" in problem
            with psycopg.connect(dsn) as producer:
                farm.publish_batch(producer, [{"bad": False}] * 5, queue="q")
            await eventually(lambda: left() == bad, "the 5 healthy rows acked beside the bad one")
            assert runtime.problems.paused == {}
            assert "terminal write" in (runtime.problem or "")
            assert conn.execute("SELECT count(*) FROM outbox_dlq").fetchone() == (0,)

            conn.execute(sql.SQL("GRANT INSERT ON outbox_dlq TO {}").format(ident))
            await eventually(lambda: left() == [], "the bad row dead-lettered once granted")
            dead = conn.execute("SELECT original_id FROM outbox_dlq").fetchall()
            assert [row[0] for row in dead] == bad
            await eventually(lambda: runtime.problem is None, "no problem any more")
        finally:
            await runtime.stop()

    asyncio.run(scenario())
