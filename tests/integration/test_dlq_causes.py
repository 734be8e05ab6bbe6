"""Dead letters grouped by cause (migration 0009): the normalising rule, the counts its
triggers keep whatever writes or deletes the rows, and the cause as a filter."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from outbox_farm.admin import (
    CauseGroup,
    DlqFilter,
    When,
    dlq_causes,
    dlq_count,
    dlq_list,
    dlq_purge,
    dlq_replay,
    dlq_summary,
    queue_stats,
)
from outbox_farm.db.operator import AdminSql
from outbox_farm.errors import SchemaError
from outbox_farm.names import TableNames
from outbox_farm.ops.migrate import migrate
from outbox_farm.ops.schema_check import check_schema
from tests.integration.roles import acting_as
from tests.integration.test_admin_dlq import dead

NAMES = TableNames.build("outbox", "outbox_dlq")
Conn = psycopg.Connection[Any]
FRAMES = "\nTraceback (innermost frames last):\n  File 'app.py', line 7, in on_order\n"


@pytest.mark.parametrize(
    ("exception", "cause"),
    [
        (None, "(no exception recorded)"),
        ("", "(no exception recorded)"),
        ("  \n ", "(no exception recorded)"),
        ("KeyError('sku')" + FRAMES, "KeyError('sku')"),
        ("TimeoutError()", "TimeoutError()"),
        ("ValueError('order 42 took 3.5s')", "ValueError('order <n> took <n>s')"),
        ("ValueError('order-42 in q5')", "ValueError('order-<n> in q5')"),
        ("LookupError('0f6b6d5e-8a2b-4a4e-9d7c-1234567890ab')", "LookupError('<uuid>')"),
        ("<Conn object at 0x7f3a2b1c90>", "<Conn object at <hex>>"),
        ("Refused('deadbeefdeadbeef12')", "Refused('<hex>')"),
        ("ValueError('" + "x" * 40 + "')", "ValueError('...')"),
        ('ValueError("' + "y" * 40 + '")', 'ValueError("...")'),
        (
            "Traceback (most recent call last):\n  File 'a.py', line 3\nKeyError: 'sku'\n",
            "KeyError: 'sku'",
        ),
        ("E('a   b\tc')", "E('a b c')"),
        ("word " * 100, ("word " * 40)[:199] + "…"),
    ],
)
def test_the_cause_of_an_exception(conn: Conn, exception: str | None, cause: str) -> None:
    row = conn.execute("SELECT outbox_dlq_cause(%s)", [exception]).fetchone()
    assert row == (cause,)


def groups(conn: Conn, where: DlqFilter | None = None) -> dict[str, int]:
    return {g.cause: g.rows for g in dlq_causes(conn, NAMES, where or DlqFilter())}


def test_rows_that_differ_in_volatile_parts_group_under_one_cause(conn: Conn) -> None:
    for n in range(30):
        dead(conn, queue="orders", exception=f"KeyError('sku')\n{FRAMES} line {n}")
    for n in range(10):
        dead(conn, queue="mail" if n % 2 else "orders", exception=f"TimeoutError({n * 7}.5)")
    dead(conn, queue="mail", reason="rejected", exception=None)
    found = dlq_causes(conn, NAMES, DlqFilter())
    assert [(g.cause, g.rows) for g in found] == [
        ("KeyError('sku')", 30),
        ("TimeoutError(<n>)", 10),
        ("(no exception recorded)", 1),
    ]
    timeouts = found[1]
    assert isinstance(timeouts, CauseGroup)
    assert (timeouts.queues, timeouts.reasons) == (("mail", "orders"), ("retry_terminal",))
    newest = dlq_list(conn, NAMES, DlqFilter(grep="TimeoutError"), limit=1)[0]
    assert timeouts.last_failed_at == newest.failed_at
    assert groups(conn, DlqFilter(queue="mail")) == {"TimeoutError(<n>)": 5, found[2].cause: 1}
    assert groups(conn, DlqFilter(reason="rejected")) == {"(no exception recorded)": 1}
    assert [g.cause for g in dlq_causes(conn, NAMES, DlqFilter(), limit=1)] == ["KeyError('sku')"]


def test_the_counts_follow_every_insert_update_delete_and_truncate(conn: Conn) -> None:
    """The kept counts against a GROUP BY of the table itself, after each kind of write."""

    def recount() -> dict[str, int]:
        rows = conn.execute(
            "SELECT outbox_dlq_cause(last_exception), count(*) FROM outbox_dlq GROUP BY 1"
        ).fetchall()
        return {cause: int(n) for cause, n in rows}

    for n in range(6):
        dead(conn, queue=f"q{n % 2}", exception=f"E({n})" if n < 4 else "F()")
    assert groups(conn) == recount() == {"E(<n>)": 4, "F()": 2}
    conn.execute("UPDATE outbox_dlq SET last_exception = 'G()' WHERE last_exception = 'E(0)'")
    assert groups(conn) == recount() == {"E(<n>)": 3, "F()": 2, "G()": 1}
    dlq_purge(conn, NAMES, DlqFilter(cause="F()"))
    assert groups(conn) == recount() == {"E(<n>)": 3, "G()": 1}
    dlq_replay(conn, NAMES, DlqFilter(queue="q1"))
    assert groups(conn) == recount()
    kept = conn.execute("SELECT count(*), min(row_count) FROM outbox_dlq_causes").fetchone()
    assert kept == (len(recount()), 1)  # a count that reached zero is gone
    conn.execute("TRUNCATE outbox_dlq")
    assert groups(conn) == recount() == {}


def test_a_cause_selects_its_rows_for_list_count_summary_replay_and_purge(conn: Conn) -> None:
    keys = [dead(conn, exception=f"KeyError('sku') {n}") for n in range(3)]
    other = dead(conn, exception="TimeoutError()")
    where = DlqFilter(cause="KeyError('sku') <n>")
    assert {r.id for r in dlq_list(conn, NAMES, where)} == set(keys)
    assert dlq_count(conn, NAMES, where) == (3, True)
    assert dlq_summary(conn, NAMES, where).rows == 3
    assert {r.id for r in dlq_list(conn, NAMES, DlqFilter(cause="TimeoutError()"))} == {other}
    assert dlq_list(conn, NAMES, DlqFilter(cause="KeyError('sku')")) == []  # exact, not a prefix
    assert dlq_replay(conn, NAMES, where).rows == 3
    assert {r.id for r in dlq_list(conn, NAMES, DlqFilter())} == {other}
    assert dlq_purge(conn, NAMES, DlqFilter(cause="TimeoutError()")).rows == 1


def test_a_time_filter_groups_the_rows_it_matches(conn: Conn) -> None:
    dead(conn, age="3 hours", exception="Old()")
    dead(conn, age="1 minute", exception="New(1)")
    dead(conn, age="2 minutes", exception="New(2)")
    assert groups(conn, DlqFilter(since=When.parse("1h"))) == {"New(<n>)": 2}
    assert groups(conn, DlqFilter(until=When.parse("1h"))) == {"Old()": 1}
    assert groups(conn, DlqFilter(grep="new", cause="New(<n>)")) == {"New(<n>)": 2}


def test_grouping_reads_the_kept_counts_not_the_rows(conn: Conn) -> None:
    """The plan of an unfiltered grouping touches the counts table and the DLQ's cause index
    only: it costs the causes, not the dead letters (seq scans off: on a table of one row the
    planner rightly prefers them; the bench measures a million)."""
    dead(conn)
    conn.execute("SET enable_seqscan = off")
    statement = AdminSql(NAMES).render("admin_dlq_causes")
    params = {"queue": None, "reason": None, "cause": None, "limit": 20}
    plan = str(conn.execute("EXPLAIN " + statement, params).fetchall())
    assert "outbox_dlq_causes" in plan
    assert "outbox_dlq_cause_idx" in plan
    assert "Seq Scan on outbox_dlq " not in plan


def test_a_dlq_without_migration_0009_says_to_migrate(conn: Conn) -> None:
    dead(conn)
    conn.execute("DROP FUNCTION outbox_dlq_causes_count() CASCADE")  # and its triggers
    conn.execute("DROP FUNCTION outbox_dlq_cause(text) CASCADE")  # and the index on it
    conn.execute("DROP TABLE outbox_dlq_causes")
    with pytest.raises(SchemaError, match=r"migration 0009\).*outbox-farm migrate"):
        dlq_causes(conn, NAMES, DlqFilter())
    with pytest.raises(SchemaError, match="outbox-farm migrate"):
        dlq_list(conn, NAMES, DlqFilter(cause="ValueError('bad sku')"))
    assert len(dlq_list(conn, NAMES, DlqFilter(queue="orders"))) == 1  # the other filters work
    (orders,) = queue_stats(conn, NAMES)  # and `stats`, without the causes
    assert (orders.queue, orders.dlq_total("total").value, orders.causes) == ("orders", 1, [])


def test_concurrent_writers_keep_the_counts_exact(dsn: str, conn: Conn) -> None:
    """Writers inserting and deleting rows of the same causes at once, in different orders
    within their statements: each count row is taken in key order, so no two statements wait
    on each other in a cycle, and the counts end equal to a recount."""
    errors: list[BaseException] = []

    def writer(seed: int) -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as own:
                for batch in range(15):
                    own.execute(
                        "INSERT INTO outbox_dlq (original_id, queue, payload, deliveries_count, "
                        "created_at, failure_reason, last_exception) "
                        "SELECT g, 'q' || (g %% 2), 'x', 1, now(), 'rejected', "
                        "format('E%%s(%%s)', (g * %(seed)s) %% 5, g) "
                        "FROM generate_series(%(first)s, %(first)s + 40) AS g "
                        "ORDER BY (g * %(seed)s) %% 7 DESC",
                        {"seed": seed, "first": batch * 100},
                    )
                    own.execute(
                        "DELETE FROM outbox_dlq WHERE id IN (SELECT id FROM outbox_dlq "
                        "ORDER BY random() LIMIT 10)"
                    )
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(seed,)) for seed in (1, 3, 7, 11)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == []
    kept = conn.execute(
        "SELECT queue, failure_reason, cause, row_count FROM outbox_dlq_causes ORDER BY 1, 2, 3"
    ).fetchall()
    counted = conn.execute(
        "SELECT queue, failure_reason, outbox_dlq_cause(last_exception), count(*) "
        "FROM outbox_dlq GROUP BY 1, 2, 3 ORDER BY 1, 2, 3"
    ).fetchall()
    assert kept == counted
    rows = conn.execute("SELECT count(*) FROM outbox_dlq").fetchone()
    assert rows is not None
    # 41 written, at most 10 deleted, per batch: two writers may pick the same row to delete
    assert sum(n for *_, n in kept) == rows[0] >= 4 * 15 * (41 - 10)


def test_a_temporary_table_cannot_stand_in_for_the_counts(conn: Conn) -> None:
    """The counting function runs with its owner's rights: a session's temporary table of the
    counts table's name must not receive the counts (pg_temp is searched last)."""
    conn.execute("CREATE TEMP TABLE outbox_dlq_causes (LIKE public.outbox_dlq_causes)")
    dead(conn)
    assert conn.execute("SELECT count(*) FROM pg_temp.outbox_dlq_causes").fetchone() == (0,)
    assert conn.execute("SELECT row_count FROM public.outbox_dlq_causes").fetchone() == (1,)


PLANTED = [
    "CREATE FUNCTION public.planted_ne(numeric, integer) RETURNS boolean LANGUAGE plpgsql "
    "AS $$ BEGIN RAISE EXCEPTION 'planted code ran as %', current_user; END $$",
    "CREATE OPERATOR public.<> (FUNCTION = public.planted_ne, LEFTARG = numeric, "
    "RIGHTARG = integer)",
    "CREATE FUNCTION public.planted_eq(varchar, text) RETURNS boolean LANGUAGE plpgsql "
    "AS $$ BEGIN RAISE EXCEPTION 'planted code ran as %', current_user; END $$",
    "CREATE OPERATOR public.= (FUNCTION = public.planted_eq, LEFTARG = varchar, RIGHTARG = text)",
    "CREATE FUNCTION public.array_cat(text[], text[]) RETURNS text[] LANGUAGE plpgsql "
    "AS $$ BEGIN RAISE EXCEPTION 'planted code ran as %', current_user; END $$",
]


def test_operators_and_functions_planted_in_public_never_run_under_the_owner(conn: Conn) -> None:
    """A role with nothing but CREATE on `public` defines operators and a function that match
    the counting function's argument types better than pg_catalog's: the function runs with its
    owner's rights, so it must never call them, whoever writes the DLQ."""
    with acting_as(conn, "planter", "GRANT USAGE, CREATE ON SCHEMA public TO {}"):
        for statement in PLANTED:
            conn.execute(statement)
        conn.execute("RESET ROLE")  # the superuser's farm and tools write the DLQ
        # Positive control: on the default search path they are what such operators find.
        with pytest.raises(psycopg.errors.RaiseException, match="planted code ran as postgres"):
            conn.execute("SELECT sum(n) <> 0 FROM (VALUES (1::bigint)) AS v(n)")
        dead(conn, exception="E(1)")
        dead(conn, exception="E(2)")
        conn.execute("UPDATE outbox_dlq SET last_exception = 'F()' WHERE last_exception = 'E(1)'")
        conn.execute("DELETE FROM outbox_dlq WHERE last_exception = 'F()'")
        assert groups(conn) == {"E(<n>)": 1}
        conn.execute("TRUNCATE outbox_dlq")
        assert groups(conn) == {}


@pytest.mark.parametrize(("schema", "search_path"), [("app.", "public"), ("", "app, public")])
def test_the_counts_live_beside_a_dlq_in_another_schema(
    empty_dsn: str, schema: str, search_path: str
) -> None:
    """The counting function finds its table and the cause function by the schema it was made
    in, not by a search path, whether the DLQ's name carries that schema or not."""
    names = TableNames.build(f"{schema}jobs", f"{schema}jobs_dlq")
    with psycopg.connect(empty_dsn, autocommit=True) as admin:
        admin.execute("CREATE SCHEMA app")
        admin.execute("SELECT set_config('search_path', %s, false)", [search_path])
        migrate(admin, names)
        admin.execute("SET search_path = public")
        admin.execute(
            "INSERT INTO app.jobs_dlq (original_id, queue, payload, deliveries_count, "
            "created_at, failure_reason, last_exception) "
            "VALUES (1, 'q', 'x', 1, now(), 'rejected', 'E(7)')"
        )
        counted = admin.execute("SELECT cause, row_count FROM app.jobs_dlq_causes").fetchall()
        assert counted == [("E(<n>)", 1)]
        # The farm-wide tables (code, queue controls) are where migrate's search path put
        # them: the check looks with the path the farm would run with, as migrate ran.
        admin.execute("SELECT set_config('search_path', %s, false)", [search_path])
        assert check_schema(admin, TableNames.build("app.jobs", "app.jobs_dlq")) == []
