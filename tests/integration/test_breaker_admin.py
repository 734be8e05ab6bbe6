"""A queue's breaker on the operator's side, on Postgres: its state reads back as the runtime
keeps it (counting, open since when, why, next probe), and an operator closes an open one in
one transaction with the NOTIFY every farm reloads on; closing one that is not open changes
nothing and says so."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

from outbox_farm.admin.queues import (
    BreakerState,
    close_breaker,
    pause_queue,
    queue_state,
    queue_states,
)
from outbox_farm.admin.stats import queue_stats
from outbox_farm.cli import main
from outbox_farm.errors import SchemaError
from outbox_farm.names import TableNames
from outbox_farm.queries import Queries
from outbox_farm.storage import CONTROL_PREFIX

Conn = psycopg.Connection[Any]
NAMES = TableNames.build("outbox", "outbox_dlq")


def fail(conn: Conn, queue: str, reason: str, *, down: bool = False, threshold: int = 3) -> bool:
    """One failure counted as a farm counts it (the runtime's own statement): open now?"""
    found = conn.execute(
        Queries(NAMES)["breaker_failed"],
        {
            "target": "outbox",
            "queue": queue,
            "threshold": threshold,
            "every": 30.0,
            "reason": reason,
            "down": down,
            "payload": CONTROL_PREFIX + queue,
        },
    ).fetchone()
    assert found is not None
    return bool(found[1])


def test_a_counting_breaker_is_listed_with_its_failures(conn: Conn) -> None:
    fail(conn, "emails", "timeout")
    fail(conn, "emails", "timeout")
    [state] = queue_states(conn, NAMES)
    assert state.queue == "emails"
    assert state.breaker == BreakerState(failures=2)
    assert not state.breaker.open
    assert not state.paused


def test_an_open_breaker_reads_back_since_why_and_next_probe(conn: Conn) -> None:
    assert fail(conn, "emails", "smtp refused", down=True)
    breaker = queue_state(conn, NAMES, "emails").breaker
    assert breaker.open
    assert breaker.reason == "smtp refused"
    assert breaker.open_since is not None
    assert breaker.probe_at is not None
    assert 29.0 <= (breaker.probe_at - breaker.open_since).total_seconds() <= 31.0
    assert [s.queue for s in queue_states(conn, NAMES)] == ["emails"]


def test_closing_an_open_breaker_resets_it_and_notifies_the_farms(dsn: str, conn: Conn) -> None:
    for _ in range(3):
        fail(conn, "emails", "timeout")
    opened = queue_state(conn, NAMES, "emails").breaker
    assert opened.open
    with psycopg.connect(dsn, autocommit=True) as listening:
        listening.execute(f"LISTEN {NAMES.channel}")
        closed = close_breaker(conn, NAMES, "emails", by="ann@host")
        payloads = [n.payload for n in listening.notifies(timeout=5.0, stop_after=1)]
    assert payloads == [CONTROL_PREFIX + "emails"]
    assert closed.was_open
    assert (closed.since, closed.reason) == (opened.open_since, "timeout")
    assert closed.state.breaker == BreakerState()
    assert closed.state.changed_by == "ann@host"
    assert queue_state(conn, NAMES, "emails").breaker == BreakerState()
    # The count starts again: the next failure alone does not open it.
    assert not fail(conn, "emails", "timeout")


def test_closing_a_breaker_not_open_changes_nothing_and_says_so(dsn: str, conn: Conn) -> None:
    fail(conn, "emails", "timeout")
    pause_queue(conn, NAMES, "emails", reason="maintenance", by="bob@host")
    before = queue_state(conn, NAMES, "emails")
    with psycopg.connect(dsn, autocommit=True) as listening:
        listening.execute(f"LISTEN {NAMES.channel}")
        closed = close_breaker(conn, NAMES, "emails", by="ann@host")
        closed_never = close_breaker(conn, NAMES, "never-seen", by="ann@host")
        pause_queue(conn, NAMES, "marker")  # a NOTIFY that comes: none came before it
        payloads = [n.payload for n in listening.notifies(timeout=5.0, stop_after=1)]
    assert payloads == [CONTROL_PREFIX + "marker"]
    assert not closed.was_open
    assert closed.state == before  # the pause, its author and the count of 1 as they were
    assert not closed_never.was_open
    assert closed_never.state.breaker == BreakerState()
    assert [s.queue for s in queue_states(conn, NAMES)] == ["emails", "marker"]


def test_the_breaker_of_another_outbox_is_its_own(conn: Conn) -> None:
    fail(conn, "emails", "down", down=True)
    other = TableNames.build("jobs")
    assert not close_breaker(conn, other, "emails").was_open
    assert queue_state(conn, NAMES, "emails").breaker.open


def test_without_the_breakers_columns_closing_says_to_migrate(conn: Conn) -> None:
    pause_queue(conn, NAMES, "emails")
    conn.execute(
        "ALTER TABLE outbox_farm_queues DROP COLUMN breaker_open_since CASCADE, "
        "DROP COLUMN breaker_failures, DROP COLUMN breaker_reason, DROP COLUMN breaker_probe_at"
    )
    assert queue_state(conn, NAMES, "emails").breaker == BreakerState()  # still reads
    with pytest.raises(SchemaError, match=r"0012.*outbox-farm migrate"):
        close_breaker(conn, NAMES, "emails")


STALE = """
INSERT INTO outbox (queue, payload, next_attempt_at)
VALUES ('held', 'x', now() - interval '90 seconds'), ('idle', 'x', now() - interval '90 seconds')
"""


def test_stats_show_an_open_breaker_and_do_not_call_its_queue_stalled(conn: Conn) -> None:
    conn.execute(STALE)
    before = {s.queue: s for s in queue_stats(conn, NAMES, stall_after=60)}
    assert before["held"].stalled is not None  # the positive control: both are stalls so far
    fail(conn, "held", "smtp refused", down=True)
    fail(conn, "counting", "timeout")
    stats = {s.queue: s for s in queue_stats(conn, NAMES, stall_after=60)}
    assert sorted(stats) == ["counting", "held", "idle"]  # a counting breaker shows, rows or not
    assert stats["held"].breaker.open
    assert stats["held"].breaker.reason == "smtp refused"
    assert stats["held"].stalled is None
    assert stats["idle"].stalled is not None  # no breaker: still a stall
    assert stats["counting"].breaker.failures == 1

    base = ["stats", "--dsn", conn.info.dsn, "--metrics-url", "", "--table", "outbox"]
    text = CliRunner().invoke(main, base)
    assert text.exit_code == 0, text.output
    table = text.output.split("\n\n")[0]
    lines = {line.split()[0]: line.split() for line in table.splitlines()}
    assert lines["queue"][-3:] == ["breaker", "paused", "stalled"]
    assert lines["held"][-3:] == ["OPEN", "-", "-"]
    assert lines["idle"][-3:] == ["-", "-", "STALLED"]
    controls = text.output.split("and breakers")[1]
    held = next(line for line in controls.splitlines() if line.startswith("held"))
    assert "open since" in held
    assert "(smtp refused), next probe" in held
    assert "1 failure(s) in a row" in controls

    as_json = CliRunner().invoke(main, [*base, "--json"])
    assert as_json.exit_code == 0, as_json.output
    queues = {q["queue"]: q for q in json.loads(as_json.stdout)["queues"]}
    assert queues["held"]["breaker"]["reason"] == "smtp refused"
    assert queues["held"]["breaker"]["open_since"] is not None
    assert queues["held"]["stalled"] is None
    assert queues["idle"]["breaker"]["open_since"] is None
