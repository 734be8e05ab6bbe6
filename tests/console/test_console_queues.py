"""Pausing, resuming and limiting queues from the console over HTTP (Starlette's TestClient, a
real database): each change confirmed first, as a replay is, made with who did it, logged,
shown on the overview; bad values refused beside their form; the console's access rules as
for replay; and a database without the controls' table still served, saying what to run."""

from __future__ import annotations

import logging
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from outbox_farm.admin.queues import limit_queue, pause_queue, queue_state
from outbox_farm.limits import Limits, Rate
from tests.console.console_kit import NAMES, TOKEN, Conn, client, csrf_of, fail, tokens
from tests.console.test_console_hardening import plan_of
from tests.console.test_console_http import confirm as confirm_dlq
from tests.console.test_console_http import preview as preview_dlq

CONSEQUENCE = "Every farm stops claiming it within a second; running handlers finish."


def preview(http: Any, csrf: str, queue: str, action: str, **form: str) -> Any:
    return http.post(
        "/queues/preview", data={"csrf": csrf, "queue": queue, "action": action, **form}
    )


def confirm(http: Any, html: str, **extra: str) -> Any:
    """Submit the confirmation form of a queue's confirmation page, as its button does."""
    form = re.search(r'<form method="post" action="/queues/run".*?</form>', html, re.DOTALL)
    assert form is not None, html
    fields = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)"', form[0]))
    return http.post("/queues/run", data={**fields, "confirm": "yes", **extra})


def events(caplog: pytest.LogCaptureFixture, event: str) -> list[dict[str, Any]]:
    return [r.__dict__ for r in caplog.records if getattr(r, "event", "") == event]


def overview_row(http: Any, queue: str) -> str:
    text = http.get("/").text
    found = re.search(rf'<tr data-queue="{re.escape(queue)}".*?</tr>', text, re.DOTALL)
    assert found is not None, text
    return found[0]


# -- pause and resume ------------------------------------------------------------------------


def test_pause_is_confirmed_then_made_logged_and_shown_and_resume_likewise(
    conn: Conn, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    with client(dsn) as http, caplog.at_level(logging.INFO, logger="outbox_farm.console"):
        page = http.get("/queues/emails")
        assert page.status_code == 200
        assert 'id="pause-form"' in page.text
        assert 'class="running"' in page.text
        csrf = csrf_of(page.text)
        asked = preview(http, csrf, "emails", "pause", reason="smtp relay down", until="30m")
        assert asked.status_code == 200, asked.text
        assert "Pause queue emails?" in asked.text
        assert CONSEQUENCE in asked.text
        assert "smtp relay down" in asked.text
        assert "30m after you confirm" in asked.text
        assert not queue_state(conn, NAMES, "emails").paused  # asking changed nothing
        assert not events(caplog, "console_action_start")
        unconfirmed = confirm(http, asked.text, confirm="no")
        assert unconfirmed.status_code == 400
        assert not queue_state(conn, NAMES, "emails").paused
        done = confirm(http, asked.text)
        assert done.status_code == 200, done.text
        assert 'data-paused="yes"' in done.text
        state = queue_state(conn, NAMES, "emails")
        assert state.paused
        assert (state.reason, state.changed_by) == ("smtp relay down", "loopback")
        assert state.paused_until is not None
        assert state.changed_at is not None
        # 30 minutes from the confirmation, on the database's clock (one transaction's now()).
        assert state.paused_until - state.changed_at == timedelta(minutes=30)
        # The overview lists the paused queue, though it has no row: paused, why, by whom.
        row = overview_row(http, "emails")
        assert 'class="paused"' in row
        assert '<span class="tag paused">paused</span>' in row
        assert "“smtp relay down”, by loopback, since" in row
        assert "until 20" in row  # its end, as a time
        listed = http.get("/queues").text
        assert 'data-queue="emails" class="paused"' in listed
        # Resume: confirmed, made, shown.
        page = http.get("/queues/emails").text
        assert 'id="resume-form"' in page
        asked = preview(http, csrf, "emails", "resume")
        assert "Resume queue emails?" in asked.text
        assert "claims its rows again within a second" in asked.text
        assert queue_state(conn, NAMES, "emails").paused
        done = confirm(http, asked.text)
        assert 'data-paused="no"' in done.text
        assert not queue_state(conn, NAMES, "emails").paused
        assert 'class="running"' in overview_row(http, "emails")
        # Resuming a queue that is not paused: said, and nothing to confirm.
        again = preview(http, csrf, "emails", "resume")
        assert "is not paused: there is nothing to resume" in again.text
        assert "/queues/run" not in again.text
    starts = events(caplog, "console_action_start")
    ends = events(caplog, "console_action")
    assert [(e["action"], e["who"], e["queue"]) for e in starts] == [
        ("pause", "loopback", "emails"),
        ("resume", "loopback", "emails"),
    ]
    assert [(e["action"], e["error"]) for e in ends] == [("pause", None), ("resume", None)]
    assert ends[0]["change"] == "pause for 30m, reason 'smtp relay down'"
    assert ends[0]["selection"] == "queue 'emails'"


def test_a_pause_until_a_time_and_the_times_refused(conn: Conn, dsn: str) -> None:
    later = (datetime.now(UTC) + timedelta(hours=3)).replace(microsecond=0)
    typed = later.strftime("%Y-%m-%dT%H:%M:%S")  # no zone: UTC, as every page shows times
    with client(dsn) as http:
        csrf = csrf_of(http.get("/queues/emails").text)
        for bad, said in (
            ("2001-01-01T00:00", "has passed"),
            ("soon-ish", "neither a duration"),
            ("0s", "a pause of no time is no pause"),
        ):
            refused = preview(http, csrf, "emails", "pause", reason="r", until=bad)
            assert refused.status_code == 400, bad
            assert said in refused.text, bad
            assert f'value="{bad}"' in refused.text  # echoed in its form, to be fixed
            assert 'id="pause-form"' in refused.text
        asked = preview(http, csrf, "emails", "pause", until=typed)
        assert asked.status_code == 200, asked.text
        assert later.strftime("%Y-%m-%d %H:%M:%S UTC") in asked.text
        assert "(no reason given)" in asked.text
        assert confirm(http, asked.text).status_code == 200
    state = queue_state(conn, NAMES, "emails")
    assert state.paused
    assert state.paused_until == later
    assert state.reason is None


def test_a_confirmation_is_refused_when_the_queue_changed_since_it_was_shown(
    conn: Conn, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    with client(dsn) as http, caplog.at_level(logging.INFO, logger="outbox_farm.console"):
        csrf = csrf_of(http.get("/queues/emails").text)
        asked = preview(http, csrf, "emails", "limit", rate="100/s", max_running="")
        # Another operator limits it meanwhile: the page shown no longer says what happens.
        limit_queue(conn, NAMES, "emails", max_running=3, by="bob@ops")
        refused = confirm(http, asked.text)
        assert refused.status_code == 409
        assert "changed since this confirmation was shown by bob@ops" in refused.text
        assert queue_state(conn, NAMES, "emails").limits == Limits(None, 3)
        # The positive control: asked again, it is done.
        asked = preview(http, csrf, "emails", "limit", rate="100/s", max_running="3")
        assert confirm(http, asked.text).status_code == 200
    assert queue_state(conn, NAMES, "emails").limits == Limits(Rate(100, 1.0), 3)
    (first, second) = events(caplog, "console_action")
    assert first["error"].startswith("refused: its controls changed")
    assert second["error"] is None


# -- limits ----------------------------------------------------------------------------------


def test_limits_are_set_shown_refused_with_the_rate_parsers_words_and_cleared(
    conn: Conn, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    conn.execute("INSERT INTO outbox (queue, payload) VALUES ('emails', 'x')")
    with client(dsn) as http, caplog.at_level(logging.INFO, logger="outbox_farm.console"):
        csrf = csrf_of(http.get("/queues/emails").text)
        bad = preview(http, csrf, "emails", "limit", rate="100 per second", max_running="5")
        assert bad.status_code == 400
        assert "not a rate: &#39;100 per second&#39;; write a count per a unit of time" in bad.text
        assert 'value="100 per second"' in bad.text  # echoed, to be fixed
        assert 'value="5"' in bad.text
        for wrong in ("0", "many", "2147483648"):
            refused = preview(http, csrf, "emails", "limit", rate="", max_running=wrong)
            assert refused.status_code == 400
            assert "is not a whole number from 1 to 2147483647" in refused.text
        assert queue_state(conn, NAMES, "emails").limits == Limits()
        asked = preview(http, csrf, "emails", "limit", rate="100/s", max_running="5")
        assert "Limit queue emails to rate 100/s · at most 5 running?" in asked.text
        assert queue_state(conn, NAMES, "emails").limits == Limits()
        done = confirm(http, asked.text)
        assert done.status_code == 200
        assert queue_state(conn, NAMES, "emails").limits == Limits(Rate(100, 1.0), 5)
        row = overview_row(http, "emails")
        assert '<span class="limits">rate 100/s · at most 5 running</span>' in row
        assert 'class="running"' in row  # limited, not paused
        page = http.get("/queues/emails").text
        assert 'name="rate" value="100/s"' in page  # the form starts from what is in force
        # The same limits again: nothing to confirm.
        same = preview(http, csrf, "emails", "limit", rate="100/s", max_running="5")
        assert "has these limits already" in same.text
        assert "/queues/run" not in same.text
        # One limit emptied: it is removed, the other kept.
        asked = preview(http, csrf, "emails", "limit", rate="6000/min", max_running="")
        assert "its limit of 5 running is removed" in asked.text
        confirm(http, asked.text)
        assert queue_state(conn, NAMES, "emails").limits == Limits(Rate(6000, 60.0))
        asked = preview(http, csrf, "emails", "limit", clear="yes")
        assert "Remove the limits of queue emails?" in asked.text
        confirm(http, asked.text)
        assert queue_state(conn, NAMES, "emails").limits == Limits()
    changes = [e["change"] for e in events(caplog, "console_action")]
    assert changes == [
        "limit to rate 100/s, at most 5 running",
        "limit to rate 6000/min",
        "clear the limits",
    ]


# -- access: as for replay -------------------------------------------------------------------


def test_every_change_needs_the_csrf_token_of_its_session_and_its_own_signed_plan(
    conn: Conn, dsn: str
) -> None:
    (row,) = fail(conn, 1)
    with client(dsn) as http:
        csrf = csrf_of(http.get("/queues/emails").text)
        form = {"queue": "emails", "action": "pause"}
        assert http.post("/queues/preview", data=form).status_code == 403
        assert preview(http, csrf[:-2] + "xx", "emails", "pause").status_code == 403
        cross = http.post(
            "/queues/preview",
            data={"csrf": csrf, **form},
            headers={"origin": "http://evil.example"},
        )
        assert cross.status_code == 403
        asked = preview(http, csrf, "emails", "pause")
        plan = re.search(r'name="plan" value="([^"]+)"', asked.text)
        assert plan is not None
        assert http.post("/queues/run", data={"plan": plan[1], "confirm": "yes"}).status_code == 403
        # A replay's plan is no pause's, and a pause's plan is no replay's.
        dry = preview_dlq(http, csrf, action="purge", scope="ids", ids=str(row))
        assert plan_of(dry.text)["action"] == "purge"
        dlq_plan = re.search(r'name="plan" value="([^"]+)"', dry.text)
        assert dlq_plan is not None
        crossed = http.post(
            "/queues/run", data={"csrf": csrf, "plan": dlq_plan[1], "confirm": "yes"}
        )
        assert crossed.status_code == 400
        assert "does not come from a page of this session" in crossed.text
        wrong_page = http.post("/dlq/run", data={"csrf": csrf, "plan": plan[1], "confirm": "yes"})
        assert wrong_page.status_code == 400
        assert not queue_state(conn, NAMES, "emails").paused  # none of those changed anything
        assert confirm(http, asked.text).status_code == 200  # the positive control
        assert queue_state(conn, NAMES, "emails").paused
        assert confirm_dlq(http, dry.text).status_code == 200
    with client(dsn) as other:  # another session's plan and token are no good here
        other.get("/")
        refused = other.post("/queues/run", data={"csrf": csrf, "plan": plan[1], "confirm": "yes"})
        assert refused.status_code == 403


def test_read_only_shows_the_state_offers_no_change_and_refuses_every_post(
    conn: Conn, dsn: str
) -> None:
    pause_queue(conn, NAMES, "emails", reason="maintenance", by="ann@ops")
    with client(dsn) as http:  # the positive control: the forms are there
        assert 'id="resume-form"' in http.get("/queues/emails").text
    with client(dsn, read_only=True) as http:
        page = http.get("/queues/emails").text
        assert "“maintenance”, by ann@ops" in page
        for path in ("/queues/emails", "/queues", "/"):
            text = http.get(path).text
            assert "/queues/preview" not in text, path
            assert "read-only" in text, path
        for path in ("/queues/preview", "/queues/run"):
            got = http.post(path, data={"csrf": "x", "queue": "emails", "action": "resume"})
            assert got.status_code == 403
            assert "read-only" in got.text
    assert queue_state(conn, NAMES, "emails").paused


def test_with_tokens_the_change_names_the_token_and_a_script_needs_no_csrf(
    conn: Conn, dsn: str
) -> None:
    with client(dsn, tokens=tokens()) as http:
        assert (
            http.post("/queues/preview", data={"queue": "q", "action": "pause"}).status_code == 401
        )
        bearer = {"authorization": "Bearer " + TOKEN}
        asked = http.post(
            "/queues/preview",
            data={"queue": "emails", "action": "pause", "reason": "deploy"},
            headers=bearer,
        )
        assert asked.status_code == 200, asked.text
        plan = re.search(r'name="plan" value="([^"]+)"', asked.text)
        assert plan is not None
        done = http.post("/queues/run", data={"plan": plan[1], "confirm": "yes"}, headers=bearer)
        assert done.status_code == 200, done.text
    state = queue_state(conn, NAMES, "emails")
    assert (state.paused, state.changed_by, state.reason) == (True, "alice", "deploy")


# -- what pages show -------------------------------------------------------------------------


def test_names_and_reasons_are_escaped_and_any_queue_name_has_its_page(
    conn: Conn, dsn: str
) -> None:
    odd = "tenant/a?b#<i>x</i>"
    pause_queue(conn, NAMES, odd, reason="<script>window.__xss = 1</script>", by="<b>ann</b>")
    with client(dsn) as http:
        for path in ("/", "/queues"):
            text = http.get(path).text
            assert "<script>window" not in text
            assert "<i>x</i>" not in text
            assert "<b>ann</b>" not in text
            assert "/queues/tenant%2Fa%3Fb%23%3Ci%3Ex%3C%2Fi%3E" in text  # its page's link
        page = http.get("/queues/tenant%2Fa%3Fb%23%3Ci%3Ex%3C%2Fi%3E")
        assert page.status_code == 200
        assert "&lt;script&gt;window.__xss = 1&lt;/script&gt;" in page.text
        assert 'id="queue-state" data-paused="yes"' in page.text
        # `?queue=` opens any queue's page, with rows or not.
        opened = http.get("/queues?queue=newsletter", follow_redirects=False)
        assert opened.status_code == 303
        assert opened.headers["location"] == "/queues/newsletter"
        too_long = http.get("/queues/" + "q" * 256)
        assert too_long.status_code == 400
        assert "1 to 255 characters" in too_long.text


def test_a_database_without_the_controls_table_is_served_and_says_to_migrate(
    conn: Conn, dsn: str
) -> None:
    conn.execute("INSERT INTO outbox (queue, payload) VALUES ('emails', 'x')")
    with client(dsn) as http:  # the positive control: controls shown and offered
        assert 'class="running"' in overview_row(http, "emails")
        assert 'id="pause-form"' in http.get("/queues/emails").text
    # Migrated to 0011, not 0012: pauses shown and made, limits refused saying what to run.
    conn.execute(
        "ALTER TABLE outbox_farm_queues DROP COLUMN rate_count CASCADE, DROP COLUMN rate_seconds,"
        " DROP COLUMN max_running, DROP COLUMN tokens, DROP COLUMN tokens_at"
    )
    with client(dsn) as http:
        assert 'class="running"' in overview_row(http, "emails")
        csrf = csrf_of(http.get("/queues/emails").text)
        asked = preview(http, csrf, "emails", "limit", rate="5/s")
        refused = confirm(http, asked.text)
        assert refused.status_code == 503
        assert "limits&#39; columns of outbox_farm_queues of migration 0012" in refused.text
        assert "run `outbox-farm migrate`" in refused.text
        assert confirm(http, preview(http, csrf, "emails", "pause").text).status_code == 200
    assert queue_state(conn, NAMES, "emails").paused
    conn.execute("DROP TABLE outbox_farm_queues")
    with client(dsn) as http:
        overview = http.get("/")
        assert overview.status_code == 200
        assert 'id="controls-error"' in overview.text
        assert "run `outbox-farm migrate`" in overview.text
        assert 'class="ready" data-value="1"' in overview_row(http, "emails")  # counts still
        for path in ("/queues", "/queues/emails"):
            page = http.get(path)
            assert page.status_code == 200, path
            assert "run `outbox-farm migrate`" in page.text, path
            assert "/queues/preview" not in page.text, path
        fail(conn, 1)  # a dead letter, whose page holds a form, and so the CSRF token
        csrf = csrf_of(http.get("/dlq").text)
        asked = preview(http, csrf, "emails", "pause")
        assert asked.status_code == 503
        assert "run `outbox-farm migrate`" in asked.text
