"""The operator's side of queue controls on Postgres: pause, resume and limit write the row the
farms read and notify them in the same transaction; states read back as the farms judge them
(a pause past its end is over); bad input and a database not migrated are refused with advice."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from outbox_farm.admin import (
    UNCHANGED,
    QueueState,
    limit_queue,
    pause_queue,
    queue_state,
    queue_states,
    resume_queue,
)
from outbox_farm.errors import ConfigurationError, SchemaError
from outbox_farm.limits import Limits, Rate, parse_rate
from outbox_farm.names import TableNames
from outbox_farm.storage import CONTROL_PREFIX

Conn = psycopg.Connection[Any]
NAMES = TableNames.build("outbox", "outbox_dlq")


def row(conn: Conn, queue: str) -> tuple[Any, ...] | None:
    return conn.execute(
        "SELECT paused, paused_until, reason, changed_by, rate_count, rate_seconds, max_running,"
        " tokens FROM outbox_farm_queues WHERE target = 'outbox' AND queue = %s",
        [queue],
    ).fetchone()


def test_a_queue_never_touched_is_free(conn: Conn) -> None:
    assert queue_state(conn, NAMES, "emails") == QueueState(
        "emails", False, None, None, None, None, Limits()
    )
    assert queue_states(conn, NAMES) == []


def test_pause_writes_the_row_the_farms_read_and_resume_ends_it(conn: Conn) -> None:
    state = pause_queue(conn, NAMES, "emails", reason="smtp down", by="ann@host")
    assert state.paused
    assert state.paused_until is None
    assert (state.reason, state.changed_by) == ("smtp down", "ann@host")
    assert state.changed_at is not None
    assert row(conn, "emails")[:4] == (True, None, "smtp down", "ann@host")  # type: ignore[index]
    assert queue_state(conn, NAMES, "emails") == state
    assert [s.queue for s in queue_states(conn, NAMES)] == ["emails"]

    resumed = resume_queue(conn, NAMES, "emails", by="bob@host")
    assert not resumed.paused
    assert (resumed.reason, resumed.changed_by) == (None, "bob@host")
    assert row(conn, "emails")[0] is False  # type: ignore[index]


def test_each_change_notifies_the_farms_once_it_commits(dsn: str, conn: Conn) -> None:
    with psycopg.connect(dsn, autocommit=True) as listening:
        listening.execute(f"LISTEN {NAMES.channel}")
        pause_queue(conn, NAMES, "emails")
        limit_queue(conn, NAMES, "emails", max_running=3)
        resume_queue(conn, NAMES, "emails")
        payloads = [n.payload for n in listening.notifies(timeout=5.0, stop_after=3)]
    assert payloads == [CONTROL_PREFIX + "emails"] * 3


def test_the_rows_are_the_outboxs_own(conn: Conn) -> None:
    other = TableNames.build("jobs")
    pause_queue(conn, NAMES, "emails")
    assert not queue_state(conn, other, "emails").paused
    assert queue_states(conn, other) == []
    assert queue_state(conn, NAMES, "emails").paused


def test_a_pause_with_an_end_is_over_once_it_has_passed(conn: Conn) -> None:
    until = datetime.now(UTC) + timedelta(hours=1)
    state = pause_queue(conn, NAMES, "emails", until=until)
    assert state.paused
    assert state.paused_until == until
    # The end moved into the past, as time would: the pause reads as over, as the farms see it.
    conn.execute(
        "UPDATE outbox_farm_queues SET paused_until = now() - interval '1 second' "
        "WHERE queue = 'emails'"
    )
    after = queue_state(conn, NAMES, "emails")
    assert not after.paused
    assert after.paused_until is None


def test_a_pause_for_a_duration_ends_on_the_database_clock(conn: Conn) -> None:
    state = pause_queue(conn, NAMES, "emails", seconds=600)
    (now,) = conn.execute("SELECT now()").fetchone()  # type: ignore[misc]
    assert state.paused_until is not None
    assert timedelta(seconds=590) < state.paused_until - now <= timedelta(seconds=600)


def test_an_end_already_past_is_refused_and_changes_nothing(conn: Conn) -> None:
    with pytest.raises(ConfigurationError, match="has passed already"):
        pause_queue(conn, NAMES, "emails", until=datetime.now(UTC) - timedelta(seconds=5))
    assert row(conn, "emails") is None
    with pytest.raises(ConfigurationError, match="time zone"):
        pause_queue(conn, NAMES, "emails", until=datetime(2999, 1, 1))
    with pytest.raises(ConfigurationError, match="not both"):
        pause_queue(conn, NAMES, "emails", until=datetime.now(UTC), seconds=5)


@pytest.mark.parametrize("queue", ["", "q" * 256, "a\x00b"])
def test_a_bad_queue_name_is_refused_before_any_sql(conn: Conn, queue: str) -> None:
    with pytest.raises(ConfigurationError, match="1 to 255 characters"):
        pause_queue(conn, NAMES, queue)
    assert queue_states(conn, NAMES) == []


def test_the_longest_queue_name_is_paused(conn: Conn) -> None:
    assert pause_queue(conn, NAMES, "q" * 255).paused


def test_limits_are_set_left_and_cleared_one_by_one(conn: Conn) -> None:
    state = limit_queue(conn, NAMES, "emails", rate=parse_rate("6000/min"), by="ann@host")
    assert state.limits == Limits(Rate(6000, 60.0), None)
    assert str(state.limits.rate) == "6000/min"
    assert not state.paused

    state = limit_queue(conn, NAMES, "emails", max_running=4)
    assert state.limits == Limits(Rate(6000, 60.0), 4)

    state = limit_queue(conn, NAMES, "emails", rate=None)
    assert state.limits == Limits(None, 4)
    state = limit_queue(conn, NAMES, "emails", max_running=None, rate=UNCHANGED)
    assert state.limits == Limits()
    assert row(conn, "emails")[4:7] == (None, None, None)  # type: ignore[index]


def test_a_queue_limited_per_key_only_is_listed_with_its_limit(conn: Conn) -> None:
    """`queue list` and the console list what `queue_states` reads: a queue whose one control
    is its per-key limit is among them, and stays (no longer limited) once it is cleared."""
    state = limit_queue(conn, NAMES, "invoices", key_max_running=3, by="ann@host")
    assert state.limits == Limits(key_max_running=3)
    assert state.limits  # limited: the console never leaves it out
    assert queue_states(conn, NAMES) == [state]
    assert queue_state(conn, NAMES, "invoices") == state
    kept = limit_queue(conn, NAMES, "invoices", max_running=5)
    assert kept.limits == Limits(None, 5, 3)
    cleared = limit_queue(conn, NAMES, "invoices", max_running=None, key_max_running=None)
    assert cleared.limits == Limits()
    assert [s.queue for s in queue_states(conn, NAMES)] == ["invoices"]


@pytest.mark.parametrize("most", [0, -1, 2**31])
def test_a_most_running_per_key_out_of_range_is_refused(conn: Conn, most: int) -> None:
    with pytest.raises(ConfigurationError, match="key_max_running must be 1 to"):
        limit_queue(conn, NAMES, "invoices", key_max_running=most)
    assert row(conn, "invoices") is None
    # The positive control: the bounds themselves are taken.
    for bound in (1, 2**31 - 1):
        state = limit_queue(conn, NAMES, "invoices", key_max_running=bound)
        assert state.limits == Limits(key_max_running=bound)


def test_before_0014_the_states_read_without_a_per_key_limit(conn: Conn) -> None:
    conn.execute("ALTER TABLE outbox DROP COLUMN fair_key")
    conn.execute("ALTER TABLE outbox_farm_queues DROP COLUMN key_max_running")
    limit_queue(conn, NAMES, "invoices", max_running=2)
    (state,) = queue_states(conn, NAMES)
    assert state.limits == Limits(None, 2, None)
    with pytest.raises(SchemaError, match=r"migration 0014.*run `outbox-farm migrate`"):
        limit_queue(conn, NAMES, "invoices", key_max_running=None)
    assert queue_state(conn, NAMES, "invoices") == state  # refused whole, nothing changed


def test_a_limit_leaves_the_pause_and_a_pause_leaves_the_limits(conn: Conn) -> None:
    pause_queue(conn, NAMES, "emails", reason="why")
    state = limit_queue(conn, NAMES, "emails", max_running=2)
    assert state.paused
    assert state.reason == "why"
    state = resume_queue(conn, NAMES, "emails")
    assert not state.paused
    assert state.limits == Limits(None, 2)


def test_a_changed_rate_refills_the_bucket_and_a_kept_one_does_not(conn: Conn) -> None:
    limit_queue(conn, NAMES, "emails", rate=Rate(10, 1.0))
    conn.execute("UPDATE outbox_farm_queues SET tokens = 0.5, tokens_at = now()")
    limit_queue(conn, NAMES, "emails", max_running=3)
    assert row(conn, "emails")[7] == 0.5  # type: ignore[index]
    limit_queue(conn, NAMES, "emails", rate=Rate(20, 1.0))
    assert row(conn, "emails")[7] is None  # type: ignore[index]


@pytest.mark.parametrize("most", [0, -1, 2**31])
def test_a_most_running_out_of_range_is_refused(conn: Conn, most: int) -> None:
    with pytest.raises(ConfigurationError, match="max_running must be 1 to"):
        limit_queue(conn, NAMES, "emails", max_running=most)
    assert row(conn, "emails") is None


def test_a_database_without_the_controls_table_says_to_migrate(conn: Conn) -> None:
    conn.execute("DROP TABLE outbox_farm_queues")
    for call in (
        lambda: pause_queue(conn, NAMES, "emails"),
        lambda: resume_queue(conn, NAMES, "emails"),
        lambda: limit_queue(conn, NAMES, "emails", max_running=1),
        lambda: queue_states(conn, NAMES),
        lambda: queue_state(conn, NAMES, "emails"),
    ):
        with pytest.raises(SchemaError, match="run `outbox-farm migrate`"):
            call()


def test_a_database_without_the_limits_columns_pauses_but_refuses_limits(conn: Conn) -> None:
    conn.execute(
        "ALTER TABLE outbox_farm_queues DROP COLUMN rate_count, DROP COLUMN rate_seconds, "
        "DROP COLUMN max_running, DROP COLUMN tokens, DROP COLUMN tokens_at"
    )
    assert pause_queue(conn, NAMES, "emails").paused
    assert queue_state(conn, NAMES, "emails").limits == Limits()
    with pytest.raises(SchemaError, match=r"migration 0012.*run `outbox-farm migrate`"):
        limit_queue(conn, NAMES, "emails", max_running=1)


def test_a_change_on_a_connection_not_in_autocommit_commits_too(dsn: str) -> None:
    """The change is one transaction of its own; on a connection not in autocommit mode it
    commits too (psycopg's transaction block), so it reaches the farms."""
    with psycopg.connect(dsn) as conn:
        pause_queue(conn, NAMES, "emails")
    with psycopg.connect(dsn, autocommit=True) as check:
        assert queue_state(check, NAMES, "emails").paused
