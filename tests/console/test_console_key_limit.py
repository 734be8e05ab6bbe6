"""A queue's most running of each fair key from the console over HTTP (a real database): shown
beside the other limits wherever they are, set and cleared through the limits' form (confirmed,
logged, a bad value refused beside the form), and on a database before migration 0014 the
other limits still set while a per-key one is refused, beside the form, saying to migrate."""

from __future__ import annotations

import html
import logging
import re
from typing import Any

import pytest

from outbox_farm.admin.queues import limit_queue, queue_state
from outbox_farm.limits import Limits, Rate
from tests.console.console_kit import NAMES, Conn, client, csrf_of
from tests.console.test_console_queues import confirm, events, overview_row, preview


def limit(http: Any, csrf: str, rate: str = "", most: str = "", per_key: str = "") -> str:
    """The confirmation page of the limits' form filled so."""
    asked = preview(
        http, csrf, "invoices", "limit", rate=rate, max_running=most, key_max_running=per_key
    )
    assert asked.status_code == 200, asked.text
    return str(asked.text)


def consequence(page: str) -> str:
    found = re.search(r'<p id="consequence">(.*?)</p>', page, re.DOTALL)
    assert found is not None, page
    return html.unescape(found[1])


def test_a_per_key_limit_is_set_shown_refused_and_removed_through_the_form(
    conn: Conn, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    with client(dsn) as http, caplog.at_level(logging.INFO, logger="outbox_farm.console"):
        page = http.get("/queues/invoices").text
        assert 'name="key_max_running" value=""' in page
        csrf = csrf_of(page)
        for wrong in ("0", "some", "2147483648"):
            refused = preview(
                http, csrf, "invoices", "limit", rate="", max_running="", key_max_running=wrong
            )
            assert refused.status_code == 400, wrong
            assert "at most how many running of each fair key?" in refused.text
            assert "is not a whole number from 1 to 2147483647" in refused.text
            assert f'name="key_max_running" value="{wrong}"' in refused.text  # to be fixed
        assert queue_state(conn, NAMES, "invoices").limits == Limits()

        asked = limit(http, csrf, per_key="3")
        assert "Limit queue invoices to at most 3 per key?" in asked
        assert consequence(asked) == (
            "Every farm on every host applies this limit within a second, together: at most 3 "
            "rows of each fair key run at once (rows without one count as one key). Running "
            "handlers are not stopped."
        )
        assert queue_state(conn, NAMES, "invoices").limits == Limits()  # asking changed nothing
        done = confirm(http, asked)
        assert done.status_code == 200, done.text
        assert queue_state(conn, NAMES, "invoices").limits == Limits(key_max_running=3)
        # Shown wherever the other limits are: the overview, the list, the queue's page.
        shown = '<span class="limits">at most 3 per key</span>'
        assert shown in overview_row(http, "invoices")  # limited per key only: never left out
        assert shown in http.get("/queues").text
        page = http.get("/queues/invoices").text
        assert shown in page
        assert 'name="key_max_running" value="3"' in page  # the form starts from it
        same = preview(
            http, csrf, "invoices", "limit", rate="", max_running="", key_max_running="3"
        )
        assert "has these limits already" in same.text
        assert "/queues/run" not in same.text

        # All three at once, then the per-key one emptied: removed, the others kept.
        asked = limit(http, csrf, rate="100/s", most="5", per_key="2")
        assert "to rate 100/s · at most 5 running · at most 2 per key?" in asked
        assert consequence(asked).startswith(
            "Every farm on every host applies these limits within a second, together: at most "
            "100/s rows start, counted across every process, at most 5 run at once, and at most "
            "2 rows of each fair key run at once"
        )
        confirm(http, asked)
        assert queue_state(conn, NAMES, "invoices").limits == Limits(Rate(100, 1.0), 5, 2)
        asked = limit(http, csrf, rate="100/s", most="5")
        assert "; its limit of 2 running per fair key is removed." in consequence(asked)
        confirm(http, asked)
        assert queue_state(conn, NAMES, "invoices").limits == Limits(Rate(100, 1.0), 5)
        # Remove the limits: the per-key one with them.
        limit_queue(conn, NAMES, "invoices", key_max_running=4)
        asked = preview(http, csrf, "invoices", "limit", clear="yes").text
        assert "Remove the limits of queue invoices?" in asked
        assert confirm(http, asked).status_code == 200
        assert queue_state(conn, NAMES, "invoices").limits == Limits()
    changes = [e["change"] for e in events(caplog, "console_action")]
    assert changes == [
        "limit to at most 3 running per fair key",
        "limit to rate 100/s, at most 5 running, at most 2 running per fair key",
        "limit to rate 100/s, at most 5 running",
        "clear the limits",
    ]


def test_before_migration_0014_the_form_sets_the_other_limits_and_refuses_a_per_key_one(
    conn: Conn, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    conn.execute("DELETE FROM outbox_farm_migrations WHERE version = 14")
    conn.execute("ALTER TABLE outbox DROP COLUMN fair_key")
    conn.execute("ALTER TABLE outbox_farm_queues DROP COLUMN key_max_running")
    with client(dsn) as http, caplog.at_level(logging.INFO, logger="outbox_farm.console"):
        csrf = csrf_of(http.get("/queues/invoices").text)
        # The per-key field left empty: the rate and the most running are set, and removed.
        done = confirm(http, limit(http, csrf, rate="5/s", most="4"))
        assert done.status_code == 200, done.text
        assert queue_state(conn, NAMES, "invoices").limits == Limits(Rate(5, 1.0), 4)
        # A per-key limit: confirmed, then refused beside the form as typed, nothing changed.
        refused = confirm(http, limit(http, csrf, rate="10/s", most="4", per_key="2"))
        assert refused.status_code == 503
        assert 'id="limit-form"' in refused.text
        message = re.search(r'<p class="error" id="error-message">(.*?)</p>', refused.text)
        assert message is not None, refused.text
        assert "migration 0014" in message[1]
        assert "run `outbox-farm migrate`" in message[1]
        assert 'name="rate" value="10/s"' in refused.text
        assert 'name="key_max_running" value="2"' in refused.text
        assert queue_state(conn, NAMES, "invoices").limits == Limits(Rate(5, 1.0), 4)
        cleared = confirm(http, preview(http, csrf, "invoices", "limit", clear="yes").text)
        assert cleared.status_code == 200, cleared.text
        assert queue_state(conn, NAMES, "invoices").limits == Limits()
    errors = [e["error"] for e in events(caplog, "console_action")]
    assert errors[0] is None
    assert errors[1].startswith("refused: ")
    assert "migration 0014" in errors[1]
    assert errors[2] is None
