"""A replay or purge of the console acts on exactly the rows its dry run showed, or refuses:
never on a row that took the place of one that went meanwhile."""

from __future__ import annotations

import psycopg
import pytest

from tests.console.console_kit import Conn, client, csrf_of, dlq_ids, fail
from tests.console.test_console_hardening import plan_of
from tests.console.test_console_http import confirm, preview

LATE = "TimeoutError('late')"  # a cause of its own: see the hardening test of late rows


@pytest.mark.parametrize("action", ["purge", "replay"])
def test_a_late_row_that_takes_the_place_of_a_replayed_one_is_left_alone(
    dsn: str, conn: Conn, action: str
) -> None:
    shown = fail(conn, 10, queue="junk")
    with psycopg.connect(dsn) as writer:  # takes its id now, commits after the dry run
        (late,) = fail(writer, 1, queue="junk", exception=LATE)
        shown += fail(conn, 1, queue="junk")
        assert late < shown[-1]
        with client(dsn) as http:
            csrf = csrf_of(http.get("/dlq").text)
            dry = preview(http, csrf, action=action, scope="filter", queue="junk")
            assert 'data-rows="11"' in dry.text
            assert 'id="unsettled"' in dry.text
            # Someone replays one of the rows shown; the late row commits: 11 rows match
            # within the dry run's bound again, one of them never shown.
            conn.execute("DELETE FROM outbox_dlq WHERE id = %s", [shown[0]])
            writer.commit()
            assert len(dlq_ids(conn)) == 11
            done = confirm(http, dry.text)
    assert done.status_code == 200
    assert 'data-rows="10"' in done.text
    assert "1 of those row(s) were no longer there" in done.text
    assert dlq_ids(conn) == {late}  # the rows shown went, the late one stayed


def test_a_large_plan_carries_a_digest_and_refuses_a_set_that_changed(
    dsn: str, conn: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("outbox_farm.console.plans.PLAN_IDS", 5)
    rows = fail(conn, 8, queue="junk")
    with client(dsn) as http:
        csrf = csrf_of(http.get("/dlq").text)
        dry = preview(http, csrf, action="purge", scope="filter", queue="junk")
        plan = plan_of(dry.text)
        assert plan["rows"] is None  # more ids than a plan carries: their digest
        assert plan["expected"] == 8
        conn.execute("DELETE FROM outbox_dlq WHERE id = %s", [rows[0]])
        refused = confirm(http, dry.text)
        assert refused.status_code == 400
        assert "no longer the 8 it showed" in refused.text
        assert dlq_ids(conn) == set(rows[1:])
        # The positive control: counted again, the same set, done.
        dry = preview(http, csrf, action="purge", scope="filter", queue="junk")
        assert plan_of(dry.text)["rows"] is None
        done = confirm(http, dry.text)
        assert 'data-rows="7"' in done.text
    assert dlq_ids(conn) == set()


def test_a_selection_past_what_one_action_takes_is_refused_saying_what_to_do(
    dsn: str, conn: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("outbox_farm.console.plans.MAX_ROWS", 3)
    monkeypatch.setattr("outbox_farm.console.plans.READ_PAGE", 2)  # several pages read
    rows = fail(conn, 3, queue="small") + fail(conn, 4, queue="big")
    with client(dsn) as http:
        csrf = csrf_of(http.get("/dlq").text)
        refused = preview(http, csrf, action="purge", scope="filter", queue="big")
        assert refused.status_code == 400
        assert "more than 3 rows" in refused.text
        assert "outbox-farm dlq purge" in refused.text
        dry = preview(http, csrf, action="purge", scope="filter", queue="small")
        assert sorted(plan_of(dry.text)["rows"]) == rows[:3]
        assert 'data-rows="3"' in confirm(http, dry.text).text
    assert dlq_ids(conn) == set(rows[3:])
