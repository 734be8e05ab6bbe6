"""The console in a real browser (Playwright driving Debian's Chromium) against real
`outbox-farm console` and `outbox-farm start` processes: what an operator sees and clicks.

Skipped only where Chromium or Playwright is missing, saying what to install (and failed in
CI, whose README test block installs both). Screenshots go to the test's temporary directory;
with OUTBOX_FARM_UPDATE_SCREENSHOT=1 the DLQ page's is also written to docs/console-dlq.png.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from outbox_farm.admin.queues import pause_queue, queue_state
from tests.acceptance.test_farm import FARMAPP, farm_process, free_port
from tests.console.console_kit import NAMES, Conn, chromium, console_process, dlq_ids, fail
from tests.steps import wait_for

DOCS_SHOT = Path(__file__).resolve().parents[2] / "docs" / "console-dlq.png"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as launched:
        yield launched


@pytest.fixture
def page(browser: Any, tmp_path: Path) -> Iterator[Any]:
    """A fresh browser context; any JavaScript dialog fails the test that opened it."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    tab = context.new_page()
    tab.set_default_timeout(30_000)
    dialogs: list[str] = []
    tab.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    yield tab
    context.close()
    assert not dialogs, f"a script ran and opened dialogs: {dialogs}"


def app_dir(tmp_path: Path, conn: Conn) -> Path:
    (tmp_path / "farmapp.py").write_text(FARMAPP)
    conn.execute("CREATE TABLE IF NOT EXISTS ledger (id bigint, pid int)")
    return tmp_path


def cell(page: Any, queue: str, figure: str) -> int | None:
    """The figure's number in the overview's row of `queue`, as the page shows it now."""
    found = page.locator(f'tr[data-queue="{queue}"] td.{figure}')
    if found.count() != 1:
        return None
    return int(found.get_attribute("data-value"))


def test_the_overview_follows_a_draining_farm_without_a_reload(
    page: Any, tmp_path: Path, dsn: str, conn: Conn
) -> None:
    conn.execute(
        "INSERT INTO outbox (queue, payload) SELECT 'q', 'x' FROM generate_series(1, 3000)"
    )
    port = free_port()  # the farm's /metrics, read by the console before the farm is up
    args = ("--metrics-url", f"http://127.0.0.1:{port}/metrics", "--sample-every", "0.5")
    with console_process(tmp_path, dsn, *args) as console:
        page.goto(console.url + "/")
        assert cell(page, "q", "ready") == 3000
        assert "Farm metrics unavailable" in page.locator("#farm-status").inner_text()
        # No reload from here on: htmx refreshes the live part.
        navigations: list[str] = []
        page.on("framenavigated", lambda frame: navigations.append(frame.url))
        with farm_process(
            app_dir(tmp_path, conn),
            dsn,
            procs=1,
            metrics_bind=f"127.0.0.1:{port}",
            FARMAPP_SLEEP="0.02",
            FARMAPP_CONCURRENCY="16",
        ):
            wait_for(lambda: (cell(page, "q", "ready") or 0) < 3000, "the ready count to fall", 60)
            wait_for(lambda: page.locator("td.acked").count() > 0, "the farm's rates", 60)
            wait_for(
                lambda: page.locator("figure.chart svg polyline").count() == 3, "the chart", 60
            )
            wait_for(lambda: cell(page, "q", "ready") == 0, "the queue to drain", 120)
            # Drained, the queue stays on the page, marked idle.
            wait_for(lambda: page.locator('tr[data-queue="q"].idle').count() == 1, "idle mark", 60)
            assert navigations == []
            page.screenshot(path=str(tmp_path / "overview.png"), full_page=True)
            page.goto(console.url + "/farm")
            health = page.locator("#health")
            wait_for(lambda: "healthy" in health.inner_text(), "the farm's health", 60)
            assert "worker processes running" in page.locator("#processes").inner_text()
            assert page.locator("#xmin").count() == 1


def test_filter_open_replay_and_see_it_handled_then_purge_by_filter(
    page: Any, tmp_path: Path, dsn: str, conn: Conn
) -> None:
    fail(conn, 12, queue="q", reason="retry_terminal")
    fail(conn, 10, queue="payments", reason="max_deliveries", exception="TimeoutError('gateway')")
    fail(conn, 8, queue="q", reason="rejected", exception="DeadLetter('unknown sku A-17')")
    (target,) = fail(conn, 1, queue="q", reason="rejected", payload='{"order": 42}')
    junk = fail(conn, 12, queue="junk", reason="max_deliveries")
    with (
        farm_process(app_dir(tmp_path, conn), dsn, procs=1, FARMAPP_LEDGER="1") as farm,
        console_process(tmp_path, dsn, "--metrics-url", "") as console,
    ):
        page.goto(console.url + "/dlq")
        assert page.locator("#dlq-count").get_attribute("data-total") == "43"
        # Filter by queue and reason with the form.
        page.fill('#filters input[name="queue"]', "q")
        page.select_option('#filters select[name="reason"]', "rejected")
        page.click('#filters button[type="submit"]')
        page.wait_for_url("**/dlq?*reason=rejected*")
        assert page.locator("#dlq-rows tbody tr").count() == 9
        page.fill('#filters input[name="text"]', "order")
        page.click('#filters button[type="submit"]')
        page.wait_for_url("**/dlq?*text=order*")
        assert page.locator("#dlq-rows tbody tr").count() == 1
        assert "Rows 1–1 matching" in page.locator("#dlq-count").inner_text()
        page.screenshot(path=str(tmp_path / "dlq-filtered.png"), full_page=True)
        # Open the row, replay it: a dry run first, then the confirmation.
        page.click(f'a[href="/dlq/{target}"]')
        assert "42" in page.locator("#payload").inner_text()
        assert page.locator("#frames tbody tr").count() == 1
        handled_before = int(conn.execute("SELECT count(*) FROM ledger").fetchone()[0])  # type: ignore[index]
        page.click('#row-actions button[value="replay"]')
        assert page.locator("#dry-run").get_attribute("data-rows") == "1"
        assert target in dlq_ids(conn)  # the dry run moved nothing
        page.click("#confirm")
        assert page.locator("#done").get_attribute("data-rows") == "1"
        assert target not in dlq_ids(conn)
        # The farm handles it: its handler ran, and it left the outbox.
        wait_for(
            lambda: conn.execute("SELECT count(*) FROM ledger").fetchone()[0] > handled_before,  # type: ignore[index]
            "the replayed row's handler run",
            60,
        )
        wait_for(
            lambda: conn.execute("SELECT count(*) FROM outbox").fetchone()[0] == 0,  # type: ignore[index]
            "the replayed row to leave the outbox",
            60,
        )
        assert farm.proc.poll() is None
        # Purge every row of queue junk: the whole filter, counted, confirmed.
        page.goto(console.url + "/dlq?queue=junk")
        page.click('#whole-filter button[value="purge"]')
        assert page.locator("#dry-run").get_attribute("data-rows") == "12"
        assert set(junk) <= dlq_ids(conn)
        page.click("#confirm")
        assert page.locator("#done").get_attribute("data-rows") == "12"
        assert not set(junk) & dlq_ids(conn)
        assert len(dlq_ids(conn)) == 30  # the other rows are still there
        page.goto(console.url + "/dlq")
        shot = tmp_path / "dlq.png"
        page.screenshot(path=str(shot), full_page=False)
        if os.environ.get("OUTBOX_FARM_UPDATE_SCREENSHOT") == "1":
            DOCS_SHOT.parent.mkdir(exist_ok=True)
            shutil.copyfile(shot, DOCS_SHOT)


XSS = "<script>window.__xss = 1; alert('payload')</script>"


def test_script_in_a_payload_or_header_renders_as_text(
    page: Any, tmp_path: Path, dsn: str, conn: Conn
) -> None:
    (row,) = fail(
        conn,
        1,
        payload=XSS,
        headers='{"content-type": "text/plain", "correlation_id": "<img src=x onerror=alert(2)>",'
        ' "x-note": "<script>window.__xss = 2</script>"}',
        exception="<script>window.__xss = 3</script>",
    )
    with console_process(tmp_path, dsn, "--metrics-url", "") as console:
        for path in (f"/dlq/{row}", "/dlq", "/dlq?text=%3Cscript%3E"):
            page.goto(console.url + path)
            # The positive control: scripts run on this page (htmx, ours) ...
            assert page.evaluate("typeof htmx") == "object"
            # ... but not the row's.
            assert page.evaluate("typeof window.__xss") == "undefined", path
        page.goto(console.url + f"/dlq/{row}")
        assert page.locator("#payload").inner_text() == XSS
        assert page.locator("#correlation").inner_text().startswith("<img src=x onerror=alert(2)>")
        assert "<script>window.__xss = 2</script>" in page.locator("#headers").inner_text()
        assert page.locator("#exception").inner_text() == "<script>window.__xss = 3</script>"
        assert page.locator("img").count() == 0


def test_read_only_shows_no_action(page: Any, tmp_path: Path, dsn: str, conn: Conn) -> None:
    (row,) = fail(conn, 1)
    with console_process(tmp_path, dsn, "--metrics-url", "", "--read-only") as console:
        for path in ("/dlq", f"/dlq/{row}", "/"):
            page.goto(console.url + path)
            assert page.locator("text=read-only").count() >= 1
            assert page.locator("button", has_text="Replay").count() == 0, path
            assert page.locator("button", has_text="Purge").count() == 0, path
            assert page.locator('input[name="ids"]').count() == 0, path
        assert page.locator("#payload").count() == 0  # the overview was last: no row here
        page.goto(console.url + f"/dlq/{row}")
        assert page.locator("#payload").count() == 1  # reading still works
    assert dlq_ids(conn) == {row}


def test_a_live_part_says_so_when_its_session_ends(
    page: Any, tmp_path: Path, dsn: str, conn: Conn
) -> None:
    token = "s3cret-token-of-alice-0123456789"
    (tmp_path / "tokens").write_text(f"alice:{token}\n")
    fail(conn, 1)
    args = ("--metrics-url", "", "--token-file", str(tmp_path / "tokens"))
    with console_process(tmp_path, dsn, *args) as console:
        page.goto(console.url + "/")
        page.fill('input[name="token"]', token)
        page.click('button[type="submit"]')
        page.wait_for_url(console.url + "/")
        assert page.locator("#queues").count() == 1  # the positive control: the live part
        csrf = page.locator('input[name="csrf"]').first.get_attribute("value")
        # The session ends elsewhere (another tab logs out): the next refresh is refused.
        page.request.post(console.url + "/logout", form={"csrf": csrf})
        page.locator("#live-error").wait_for(state="visible")
        assert "session has ended" in page.locator("#live-error").inner_text()
        assert page.locator("#queues").count() == 0  # the stale numbers are gone


def test_pause_a_queue_with_its_confirmation_see_it_paused_and_resume_it(
    page: Any, tmp_path: Path, dsn: str, conn: Conn
) -> None:
    conn.execute("INSERT INTO outbox (queue, payload) VALUES ('emails', 'x')")
    row = 'tr[data-queue="emails"]'
    with console_process(tmp_path, dsn, "--metrics-url", "") as console:
        page.goto(console.url + "/")
        assert page.locator(f"{row} td.control").inner_text() == "running"
        page.click(f"{row} th a")
        page.wait_for_url("**/queues/emails")
        page.fill('#pause-form input[name="reason"]', "smtp relay down")
        page.fill('#pause-form input[name="until"]', "1h")
        page.click("#pause")
        assert page.locator("h1").inner_text() == "Pause queue emails?"
        assert (
            "within a second; running handlers finish" in page.locator("#consequence").inner_text()
        )
        assert not queue_state(conn, NAMES, "emails").paused  # nothing until confirmed
        page.click("#confirm")
        assert page.locator("#done").get_attribute("data-paused") == "yes"
        state = queue_state(conn, NAMES, "emails")
        assert (state.paused, state.reason, state.changed_by) == (
            True,
            "smtp relay down",
            "loopback",
        )
        page.goto(console.url + "/")
        badge = page.locator(f"{row} .tag.paused")
        assert badge.is_visible()
        detail = page.locator(f"{row} td.control").inner_text()
        assert "“smtp relay down”, by loopback, since" in detail
        page.screenshot(path=str(tmp_path / "overview-paused.png"), full_page=True)
        # Resume from the queue's page, confirmed likewise.
        page.click(f"{row} th a")
        page.click("#resume")
        assert page.locator("h1").inner_text() == "Resume queue emails?"
        assert queue_state(conn, NAMES, "emails").paused
        page.click("#confirm")
        assert page.locator("#done").get_attribute("data-paused") == "no"
        assert not queue_state(conn, NAMES, "emails").paused
        page.goto(console.url + "/")
        assert page.locator(f"{row} td.control").inner_text() == "running"
        # Paused elsewhere (the CLI, another console): the overview shows it without a reload.
        pause_queue(conn, NAMES, "emails", reason="deploy", by="ann@ops")
        wait_for(lambda: badge.count() == 1, "the paused badge on the live overview", 60)
        assert "by ann@ops" in page.locator(f"{row} td.control").inner_text()
