"""Dead letters grouped by cause in the console: the overview and the DLQ page show the
groups, a group opens the list of its rows, and replay and purge work on it."""

from __future__ import annotations

import html
import re

from tests.console.console_kit import Conn, client, csrf_of, dlq_ids, fail
from tests.console.test_console_hardening import plan_of
from tests.console.test_console_http import confirm, preview


def _groups(page: str) -> dict[str, tuple[int, str]]:
    """Each group a page links to: its cause, its row count and its link."""
    found = re.findall(
        r'<a href="([^"]+)" class="cause" data-rows="(\d+)"><span class="mono">([^<]*)</span>',
        page,
    )
    return {html.unescape(cause): (int(rows), html.unescape(link)) for link, rows, cause in found}


def test_groups_by_cause_open_their_rows_and_purge_them(dsn: str, conn: Conn) -> None:
    key = fail(conn, 3, queue="orders", exception="KeyError('XX')")
    slow = fail(conn, 2, queue="orders", exception="TimeoutError()")
    other = fail(conn, 1, queue="mail", exception="KeyError('XX')")
    with client(dsn) as http:
        overview = http.get("/").text
        groups = _groups(overview)
        assert {cause: rows for cause, (rows, _) in groups.items()} == {
            "KeyError('XX')": 4,
            "TimeoutError()": 2,
        }
        assert "KeyError(&#39;XX&#39;)</span> × 4" in overview
        listed = http.get(groups["KeyError('XX')"][1])
        assert listed.status_code == 200
        assert set(map(int, re.findall(r'<tr data-id="(\d+)"', listed.text))) == set(key + other)
        # On the DLQ page of a queue, the groups of that queue, each keeping the filter.
        page = http.get("/dlq?queue=orders").text
        in_orders = _groups(page)
        assert {cause: rows for cause, (rows, _) in in_orders.items()} == {
            "KeyError('XX')": 3,
            "TimeoutError()": 2,
        }
        link = in_orders["KeyError('XX')"][1]
        assert "queue=orders" in link
        assert "cause=" in link
        csrf = csrf_of(page)
        dry = preview(
            http, csrf, action="purge", scope="filter", queue="orders", cause="KeyError('XX')"
        )
        assert 'data-rows="3"' in dry.text
        assert plan_of(dry.text)["cause"] == "KeyError('XX')"
        assert "cause=" in dry.text  # the selection, as the page says it
        done = confirm(http, dry.text)
        assert 'data-rows="3"' in done.text
    assert dlq_ids(conn) == set(slow + other)


def test_a_text_or_time_filter_lists_without_grouping_its_matches(dsn: str, conn: Conn) -> None:
    """Groups come from the kept counts (queue, reason); a text or time filter would have
    every matching row's cause worked out on every page, so its page lists without them."""
    (late,) = fail(conn, 1, queue="orders", exception="KeyError('XX')")
    fail(conn, 2, queue="orders", exception="TimeoutError()")
    with client(dsn) as http:
        counted = http.get("/dlq?queue=orders").text  # the positive control
        assert set(_groups(counted)) == {"KeyError('XX')", "TimeoutError()"}
        for query in ("queue=orders&text=XX", "since=1h"):
            page = http.get(f"/dlq?{query}")
            assert page.status_code == 200, query
            assert _groups(page.text) == {}, query
            assert 'id="dlq-causes"' not in page.text, query
        # The list itself still answers the text search.
        searched = http.get("/dlq?queue=orders&text=XX").text
        assert set(map(int, re.findall(r'<tr data-id="(\d+)"', searched))) == {late}
