"""A queue's breaker in the console over HTTP (Starlette's TestClient, a real database): the
overview and the queue's page show an open breaker (since, why, next probe), and "Close
breaker" is confirmed, made with who did it and logged as a pause is; the console's access
rules (CSRF, read-only, tokens) as for the other changes of a queue."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest

from outbox_farm.admin.queues import close_breaker, queue_state
from tests.console.console_kit import NAMES, TOKEN, Conn, client, csrf_of, tokens
from tests.console.test_console_queues import confirm, events, overview_row, preview
from tests.integration.test_breaker_admin import fail

BADGE = '<span class="tag bad breaker">breaker open</span>'


def trip(conn: Conn, queue: str = "emails", reason: str = "smtp refused") -> None:
    assert fail(conn, queue, reason, down=True)


def test_an_open_breaker_shows_on_the_overview_and_the_queue_page(conn: Conn, dsn: str) -> None:
    with client(dsn) as http:  # the positive control: no badge before it opens
        assert 'id="close-breaker-form"' not in http.get("/queues/emails").text
    trip(conn)
    fail(conn, "sms", "timeout")  # counting, not open
    with client(dsn) as http:
        row = overview_row(http, "emails")  # listed though it has no row
        assert 'class="breaker"' in row
        assert BADGE in row
        assert "“smtp refused”" in row
        assert "next probe" in row
        assert 'class="running"' not in row
        page = http.get("/queues/emails").text
        assert 'data-breaker="open"' in page
        assert BADGE in page
        assert "(since 20" in page
        assert 'id="breaker-note"' in page
        assert 'id="close-breaker-form"' in page
        listed = http.get("/queues").text
        assert BADGE in listed
        sms = http.get("/queues/sms").text
        assert "1 failure(s) in a row" in sms
        assert 'data-breaker="closed"' in sms
        assert 'id="close-breaker-form"' not in sms


def test_close_breaker_is_confirmed_then_made_logged_and_shown(
    conn: Conn, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    trip(conn)
    with client(dsn) as http, caplog.at_level(logging.INFO, logger="outbox_farm.console"):
        csrf = csrf_of(http.get("/queues/emails").text)
        asked = preview(http, csrf, "emails", "close-breaker")
        assert asked.status_code == 200, asked.text
        assert "Close the breaker of queue emails?" in asked.text
        assert "Every farm claims its rows again within a second" in asked.text
        assert "the breaker opens again" in asked.text
        assert BADGE in asked.text  # what is in force now
        assert queue_state(conn, NAMES, "emails").breaker.open  # asking changed nothing
        assert not events(caplog, "console_action_start")
        assert confirm(http, asked.text, confirm="no").status_code == 400
        assert queue_state(conn, NAMES, "emails").breaker.open
        done = confirm(http, asked.text)
        assert done.status_code == 200, done.text
        assert "Closed the breaker of queue <strong>emails</strong>" in done.text
        assert 'data-breaker="closed"' in done.text
        state = queue_state(conn, NAMES, "emails")
        assert not state.breaker.open
        assert state.changed_by == "loopback"
        assert BADGE not in overview_row(http, "emails")
        # Not open now: said, and nothing to confirm.
        again = preview(http, csrf, "emails", "close-breaker")
        assert "is not open: there is nothing to close" in again.text
        assert "/queues/run" not in again.text
    starts = events(caplog, "console_action_start")
    ends = events(caplog, "console_action")
    assert [(e["action"], e["who"], e["queue"]) for e in starts] == [
        ("close-breaker", "loopback", "emails")
    ]
    assert [(e["action"], e["change"], e["error"]) for e in ends] == [
        ("close-breaker", "close the breaker", None)
    ]


def test_a_breaker_closed_meanwhile_is_no_error_and_the_page_says_so(conn: Conn, dsn: str) -> None:
    trip(conn)
    with client(dsn) as http:
        csrf = csrf_of(http.get("/queues/emails").text)
        asked = preview(http, csrf, "emails", "close-breaker")
        close_breaker(conn, NAMES, "emails", by="bob@ops")  # another operator, meanwhile
        trip(conn, reason="still down")
        moved = confirm(http, asked.text)
        assert moved.status_code == 409  # as for a pause: what the page showed has changed
        assert "changed since this confirmation was shown by bob@ops" in moved.text
        assert queue_state(conn, NAMES, "emails").breaker.reason == "still down"
        asked = preview(http, csrf, "emails", "close-breaker")
        conn.execute(  # closed as a probe closes it: no author, no time of change
            "UPDATE outbox_farm_queues SET breaker_open_since = NULL, breaker_probe_at = NULL, "
            "breaker_reason = NULL, breaker_failures = 0 WHERE queue = 'emails'"
        )
        done = confirm(http, asked.text)
        assert done.status_code == 200, done.text
        assert "Nothing was done to queue <strong>emails</strong>" in done.text
        assert "not open any more" in done.text


def test_close_breaker_needs_csrf_and_is_refused_read_only_and_names_a_token(
    conn: Conn, dsn: str
) -> None:
    trip(conn)
    with client(dsn) as http:
        csrf = csrf_of(http.get("/queues/emails").text)
        form = {"queue": "emails", "action": "close-breaker"}
        assert http.post("/queues/preview", data=form).status_code == 403
        asked = preview(http, csrf, "emails", "close-breaker")
        plan = re.search(r'name="plan" value="([^"]+)"', asked.text)
        assert plan is not None
        assert http.post("/queues/run", data={"plan": plan[1], "confirm": "yes"}).status_code == 403
        assert queue_state(conn, NAMES, "emails").breaker.open
    with client(dsn, read_only=True) as http:
        page = http.get("/queues/emails").text
        assert BADGE in page  # shown...
        assert 'id="close-breaker-form"' not in page  # ...but not offered
        got = http.post("/queues/preview", data={"csrf": "x", **form})
        assert got.status_code == 403
        assert "read-only" in got.text
    assert queue_state(conn, NAMES, "emails").breaker.open
    with client(dsn, tokens=tokens()) as http:
        bearer = {"authorization": "Bearer " + TOKEN}
        asked = http.post("/queues/preview", data=form, headers=bearer)
        assert asked.status_code == 200, asked.text
        plan = re.search(r'name="plan" value="([^"]+)"', asked.text)
        assert plan is not None
        done: Any = http.post(
            "/queues/run", data={"plan": plan[1], "confirm": "yes"}, headers=bearer
        )
        assert done.status_code == 200, done.text
    state = queue_state(conn, NAMES, "emails")
    assert (state.breaker.open, state.changed_by) == (False, "alice")
