"""The console under attack and under load: a farm that answers slowly, plans that were not
previewed, bad input, sessions and tokens, TLS and IPv6, and the DLQ's indexes."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import socket
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

from outbox_farm.admin import DlqFilter
from outbox_farm.cli import main
from outbox_farm.console.security import Tokens, check_transport
from outbox_farm.console.serve import listen
from outbox_farm.console.telemetry import Sampler
from outbox_farm.db.operator import AdminSql
from outbox_farm.errors import ConfigurationError, DatabaseError
from tests.console.console_kit import NAMES, TOKEN, Conn, client, csrf_of, dlq_ids, fail, tokens
from tests.console.slow_farm import body, fake_farm, raw, trickle
from tests.console.test_console_http import HTML, confirm, preview
from tests.steps import wait_for

HEALTHY = json.dumps({"status": "ok", "problems": []}).encode()
LATE = "TimeoutError('late')"
METRICS = b"# TYPE outbox_farm_processes gauge\noutbox_farm_processes 2\n"


def plan_of(html: str) -> dict[str, Any]:
    marker = 'name="plan" value="'
    start = html.index(marker) + len(marker)
    signed = html[start : html.index('"', start)]
    encoded = signed.rpartition(".")[0]
    return dict(json.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))))


# -- 1. the farm is read by the sampler only, with a hard deadline ---------------------------


def test_a_farm_that_trickles_delays_neither_the_sampler_nor_any_page(dsn: str) -> None:
    with fake_farm({"/metrics": trickle(0.3), "/healthz": trickle(0.3)}) as url:
        sampler = Sampler(url, 5.0, timeout=1.0)
        began = time.monotonic()
        asyncio.run(sampler.sample())
        assert time.monotonic() - began < 4.0  # 1 s and a little, not the minutes a trickle takes
        assert sampler.error is not None
        assert "did not answer within 1s" in sampler.error
        assert sampler.health_error is not None
        assert "within 1s" in sampler.health_error
        with client(dsn, metrics_url=url, farm_timeout=1.0, sample_every=0.2) as http:
            # Pages answer while the sampler is stuck in a read of the farm, again and again.
            for _ in range(5):
                began = time.monotonic()
                assert http.get("/farm").status_code == 200
                assert http.get("/farm/live").status_code == 200
                # The trickle would hold a read of the farm for minutes: a page that read it
                # could not answer in seconds, even on a busy machine.
                assert time.monotonic() - began < 5.0
            page = wait_for(
                lambda: "did not answer within 1s" in (got := http.get("/farm").text) and got,
                "the sampler's failed reading shown",
                30,
            )
    assert "Farm unreachable" in page
    assert "tried" in page  # and how long ago


def test_a_farm_answer_too_big_or_not_http_is_an_error_line_not_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answers = {"/metrics": body(200, b"x" * (2 << 20)), "/healthz": raw(b"HELLO THERE\r\n\r\n")}
    with fake_farm(answers) as url, caplog.at_level(logging.WARNING):
        sampler = Sampler(url, 5.0, timeout=5.0)
        asyncio.run(sampler.sample())
    assert sampler.error is not None
    assert "more than 1,048,576 bytes" in sampler.error
    assert sampler.health_error is not None
    assert "cannot read" in sampler.health_error
    assert not [r for r in caplog.records if r.exc_info]
    # The positive control: a farm that answers is read, health and all.
    with fake_farm({"/metrics": body(200, METRICS), "/healthz": body(200, HEALTHY)}) as url:
        sampler = Sampler(url, 5.0, timeout=5.0)
        asyncio.run(sampler.sample())
    view = sampler.view()
    assert view.error is None
    assert view.latest is not None
    assert view.latest.processes == 2
    assert view.health is not None
    assert view.health.healthy
    assert view.health_age is not None


def test_credentials_in_the_metrics_url_are_never_shown(dsn: str) -> None:
    url = "http://scraper:hunter2-secret@127.0.0.1:1/metrics"
    with client(dsn, metrics_url=url, farm_timeout=1.0) as http:
        wait_for(lambda: "Farm metrics unavailable" in http.get("/").text, "a failed reading", 30)
        for path in ("/", "/overview/live", "/farm", "/farm/live"):
            text = http.get(path).text
            assert "hunter2" not in text, path
            assert "scraper" not in text, path
        assert "http://127.0.0.1:1/metrics" in http.get("/").text  # shown, without them


def test_sampler_view_runs_on_the_event_loop(dsn: str, conn: Conn) -> None:
    fail(conn, 1)
    calls: list[bool] = []
    with client(dsn) as http:
        sampler = http.app.state.sampler  # type: ignore[attr-defined]
        real = sampler.view

        def on_loop() -> Any:
            try:
                asyncio.get_running_loop()
                calls.append(True)
            except RuntimeError:  # a worker thread has no running loop
                calls.append(False)
            return real()

        sampler.view = on_loop
        for path in ("/", "/overview/live", "/farm", "/farm/live"):
            assert http.get(path).status_code == 200
    assert calls == [True] * 4


# -- 2. replay and purge run only what was previewed -----------------------------------------


def test_run_refuses_a_plan_it_did_not_sign(dsn: str, conn: Conn) -> None:
    rows = fail(conn, 101, queue="junk")
    with client(dsn) as http:
        csrf = csrf_of(http.get("/dlq").text)
        dry = preview(http, csrf, action="purge", scope="ids", ids=str(rows[0]))
        assert 'data-rows="1"' in dry.text
        # The old form's fields, raised by hand: ignored, there is no signed plan.
        forged = http.post(
            "/dlq/run",
            data={
                "csrf": csrf,
                "action": "purge",
                "scope": "filter",
                "queue": "junk",
                "upto": "999999",
                "expected": "101",
                "confirm": "yes",
            },
        )
        assert forged.status_code == 400
        assert "does not come from a dry run" in forged.text
        signed = plan_of(dry.text)
        tampered = (
            base64.urlsafe_b64encode(json.dumps({**signed, "ids": [], "upto": 999999}).encode())
            .decode()
            .rstrip("=")
        )
        marker = 'name="plan" value="'
        mac = dry.text.split(marker)[1].split('"')[0].rpartition(".")[2]
        refused = http.post(
            "/dlq/run", data={"csrf": csrf, "plan": f"{tampered}.{mac}", "confirm": "yes"}
        )
        assert refused.status_code == 400
        assert dlq_ids(conn) == set(rows)
        with client(dsn) as other:  # another session cannot use this one's plan
            other_csrf = csrf_of(other.get("/dlq").text)
            assert confirm(other, dry.text.replace(csrf, other_csrf)).status_code == 400
        assert dlq_ids(conn) == set(rows)
        done = confirm(http, dry.text)  # the positive control: the plan as signed
        assert done.status_code == 200
        assert 'data-rows="1"' in done.text
    assert dlq_ids(conn) == set(rows[1:])


def test_a_row_committed_late_below_the_bound_is_counted_or_left_alone(
    dsn: str, conn: Conn
) -> None:
    (early,) = fail(conn, 1, queue="junk")
    # The open writer's rows have a cause of their own: rows of one cause wait on the
    # transaction that last wrote that cause's count.
    with psycopg.connect(dsn) as writer:  # takes an id, commits only later
        (late,) = fail(writer, 1, queue="junk", exception=LATE)
        (after,) = fail(conn, 1, queue="junk")  # a higher id, committed at once
        assert early < late < after
        with client(dsn) as http:
            csrf = csrf_of(http.get("/dlq").text)
            # The writer is still open when the dry run ends: it cannot count the row, says
            # so, and the run leaves the row alone once it is there: it was not shown.
            dry = preview(http, csrf, action="purge", scope="filter", queue="junk")
            assert 'data-rows="2"' in dry.text
            assert 'id="unsettled"' in dry.text
            writer.commit()
            done = confirm(http, dry.text)
            assert 'data-rows="2"' in done.text
            assert dlq_ids(conn) == {late}
            fail(conn, 2, queue="junk")
    # A writer that commits while the dry run waits for it: counted, and the run agrees.
    with psycopg.connect(dsn) as writer, client(dsn) as http:
        (late2,) = fail(writer, 1, queue="junk", exception=LATE)
        fail(conn, 1, queue="junk")
        csrf = csrf_of(http.get("/dlq").text)
        answer: list[Any] = []
        counting = threading.Thread(
            target=lambda: answer.append(
                preview(http, csrf, action="purge", scope="filter", queue="junk")
            )
        )
        counting.start()
        wait_for(
            lambda: conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE query LIKE %s",
                ["%pg_snapshot_xmin(pg_current_snapshot())%"],
            ).fetchone()[0],  # type: ignore[index]
            "the dry run waiting for the open writer",
            30,
        )
        writer.commit()
        counting.join(timeout=30)
        (dry,) = answer
        assert 'id="unsettled"' not in dry.text
        assert 'data-rows="5"' in dry.text  # every junk row up to the bound, the late one too
        assert plan_of(dry.text)["upto"] > late2
        assert 'data-rows="5"' in confirm(http, dry.text).text
    assert not dlq_ids(conn) & {late, late2}


def test_times_are_fixed_at_the_dry_run_and_fewer_rows_are_worded_as_such(
    dsn: str, conn: Conn
) -> None:
    rows = fail(conn, 3, queue="junk", age="30 min")
    with client(dsn) as http:
        csrf = csrf_of(http.get("/dlq").text)
        dry = preview(http, csrf, action="purge", scope="filter", queue="junk", since="1h")
        assert 'data-rows="3"' in dry.text
        plan = plan_of(dry.text)
        assert plan["since"] is not None
        assert "T" in plan["since"]
        assert 'id="window"' in dry.text
        assert "UTC" in dry.text
        conn.execute("DELETE FROM outbox_dlq WHERE id = %s", [rows[0]])  # someone else
        done = confirm(http, dry.text)
    assert 'data-rows="2"' in done.text
    assert "1 of those row(s) were no longer there" in done.text
    assert dlq_ids(conn) == set()


# -- 3. a time without a zone is UTC ---------------------------------------------------------


def test_a_time_without_a_zone_is_utc_whatever_the_server_zone(
    dsn: str, conn: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TZ", "Asia/Tokyo")  # UTC+9: local time would shift it by 9 hours
    time.tzset()
    try:
        (row,) = fail(conn, 1)
        conn.execute(
            "UPDATE outbox_dlq SET failed_at = '2026-01-01 12:00:00+00' WHERE id = %s", [row]
        )
        with client(dsn) as http:
            after = http.get("/dlq?since=2026-01-01T12:30").text
            before = http.get("/dlq?since=2026-01-01T11:30").text
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    assert f'data-id="{row}"' not in after
    assert f'data-id="{row}"' in before


# -- 4. the action log -----------------------------------------------------------------------


def test_every_action_is_logged_before_and_after_even_when_it_fails(
    dsn: str, conn: Conn, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = fail(conn, 2)
    with client(dsn) as http, caplog.at_level(logging.INFO, logger="outbox_farm.console"):
        csrf = csrf_of(http.get("/dlq").text)
        dry = preview(http, csrf, action="purge", scope="ids", ids=[str(r) for r in rows])
        done = confirm(http, dry.text)  # the positive control
        assert 'data-rows="2"' in done.text

        def broken(*args: Any, progress: Any, **kwargs: Any) -> Any:
            progress(1)
            raise DatabaseError("the server went away mid-purge")

        monkeypatch.setattr("outbox_farm.console.plans.dlq_purge", broken)
        more = fail(conn, 1)
        dry = preview(http, csrf, action="purge", scope="ids", ids=str(more[0]))
        assert confirm(http, dry.text).status_code == 503
    events = [
        (r.__dict__["event"], r.__dict__.get("rows"), r.__dict__.get("error"))
        for r in caplog.records
        if str(getattr(r, "event", "")).startswith("console_action")
    ]
    assert events == [
        ("console_action_start", None, None),
        ("console_action", 2, None),
        ("console_action_start", None, None),
        ("console_action", 1, "DatabaseError: the server went away mid-purge"),
    ]
    assert all(r.__dict__["client"] for r in caplog.records if hasattr(r, "client"))


def test_logins_are_logged_with_the_client_address(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    with client(dsn, tokens=tokens()) as http, caplog.at_level(logging.INFO):
        http.post("/login", data={"token": "not-the-token-at-all"})
        http.post("/login", data={"token": TOKEN})
    found = {
        r.__dict__["event"]: r.__dict__["client"]
        for r in caplog.records
        if r.__dict__.get("event", "").startswith("console_login")
    }
    assert found == {"console_login_refused": "testclient", "console_login": "testclient"}


# -- 5. TLS ----------------------------------------------------------------------------------


def test_a_network_bind_needs_tls_or_a_tls_proxy(dsn: str, tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"alice:{TOKEN}\n")
    base = ["console", "--dsn", dsn, "--bind", "0.0.0.0:0", "--token-file", str(path)]
    refused = CliRunner().invoke(main, base)
    assert refused.exit_code == 2, refused.output
    assert "--tls-cert" in refused.output
    assert "--behind-tls-proxy" in refused.output
    half = CliRunner().invoke(main, [*base, "--tls-cert", str(path)])
    assert half.exit_code == 2
    assert "go together" in half.output
    bad = CliRunner().invoke(main, [*base, "--tls-cert", str(path), "--tls-key", str(path)])
    assert bad.exit_code == 2
    assert "cannot load" in bad.output
    with pytest.raises(ConfigurationError, match="cleartext"):
        check_transport("0.0.0.0", tls=False, behind_tls_proxy=False)
    check_transport("0.0.0.0", tls=True, behind_tls_proxy=False)  # the positive controls
    check_transport("0.0.0.0", tls=False, behind_tls_proxy=True)
    check_transport("127.0.0.1", tls=False, behind_tls_proxy=False)


def test_the_session_cookie_is_secure_behind_tls(dsn: str) -> None:
    with client(dsn) as http:
        assert "secure" not in http.get("/").headers["set-cookie"].lower()
    with client(dsn, secure_cookie=True) as http:
        assert "secure" in http.get("/").headers["set-cookie"].lower()
    with client(dsn, tokens=tokens(), secure_cookie=True) as http:
        logged = http.post("/login", data={"token": TOKEN}, follow_redirects=False)
        assert "secure" in logged.headers["set-cookie"].lower()


# -- 6. bad input is a 400 that says why -----------------------------------------------------


LONG_QUEUE = "q" * 256


@pytest.mark.parametrize(
    ("method", "path", "form", "status", "says"),
    [
        ("GET", "/dlq?before=99999999999999999999999", None, 400, "between 1 and"),
        ("GET", "/dlq?before=-3", None, 400, "between 1 and"),
        ("GET", "/dlq?since=99999999999d", None, 400, "longer than 100 years"),
        ("GET", "/dlq?until=10000-01-01T00:00", None, 400, "years 1 to 9999"),
        ("GET", "/dlq?queue=" + LONG_QUEUE, None, 400, "at most 255"),
        ("GET", "/dlq/99999999999999999999", None, 400, "between 1 and"),
        ("GET", "/dlq?since=0001-01-01T00:00", None, 200, "Rows 1–1 of 1"),
        (
            "POST",
            "/dlq/preview",
            {"action": "replay", "scope": "ids", "ids": "1", "delay": "99999999999d"},
            400,
            "longer than 100 years",
        ),
        (
            "POST",
            "/dlq/preview",
            {"action": "replay", "scope": "ids", "ids": "1", "to_queue": LONG_QUEUE},
            400,
            "at most 255",
        ),
        (
            "POST",
            "/dlq/preview",
            {"action": "purge", "scope": "ids", "ids": "99999999999999999999"},
            400,
            "is not a row id",
        ),
        (
            "POST",
            "/dlq/preview",
            {"action": "purge", "scope": "filter", "since": "0001-01-01T00:00+05:00"},
            200,
            "dry run",
        ),
        (
            "POST",
            "/dlq/run",
            {"plan": "1e999.x", "upto": "abc", "confirm": "yes"},
            400,
            "does not come from a dry run",
        ),
    ],
)
def test_bad_input_is_refused_with_a_clear_400(
    dsn: str,
    conn: Conn,
    method: str,
    path: str,
    form: dict[str, str] | None,
    status: int,
    says: str,
) -> None:
    fail(conn, 1, age="1 day")
    with client(dsn) as http:
        csrf = csrf_of(http.get("/dlq").text)
        if method == "GET":
            got = http.get(path)
        else:
            got = http.post(path, data={"csrf": csrf, **(form or {})})
    assert got.status_code == status, got.text
    assert says in got.text
    assert "Traceback" not in got.text
    assert "invalid literal" not in got.text


def test_a_non_ascii_cookie_is_no_session_not_an_error(dsn: str) -> None:
    odd = {"cookie": "outbox_farm_console=\u00e9t\u00e9.caf\u00e9".encode()}
    with client(dsn, tokens=tokens()) as http:
        assert http.get("/dlq", headers=odd).status_code == 401
        bearer = {"authorization": "Bearer " + TOKEN, **odd}
        assert http.get("/dlq", headers=bearer).status_code == 200  # the positive control


def test_a_value_the_database_refuses_is_a_400(
    dsn: str, conn: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    from outbox_farm.db.boundary import translate

    def refused(*args: Any, **kwargs: Any) -> Any:
        error = psycopg.errors.NumericValueOutOfRange("bigint out of range")
        raise translate(error, doing="DLQ statement failed")

    with client(dsn) as http:
        assert http.get("/dlq").status_code == 200
        monkeypatch.setattr("outbox_farm.console.views.dlq_list", refused)
        got = http.get("/dlq")
    assert got.status_code == 400
    assert "The database refused a value" in got.text


# -- 7. the DLQ's indexes, the time limit, big payloads --------------------------------------


def _plan_json(conn: Conn, statement: str, params: dict[str, Any]) -> str:
    ((plan,),) = conn.execute("EXPLAIN (FORMAT JSON) " + statement, params).fetchall()
    return json.dumps(plan)


def test_filtered_lists_read_the_queue_and_reason_indexes(conn: Conn) -> None:
    """Queue and reason mostly go together; a rare reason, and a pair that never occurs, must
    be read from the indexes of migration 0007, not by walking the primary key."""
    conn.execute(
        "INSERT INTO outbox_dlq (original_id, queue, payload, deliveries_count, created_at, "
        "failed_at, failure_reason) SELECT g, 'q' || (g % 10), '\\x00', 1, now(), now(), "
        "CASE WHEN g % 997 = 0 THEN 'rejected' WHEN g % 10 = 5 THEN 'invalid_row' "
        "ELSE 'max_deliveries' END FROM generate_series(1, 60000) AS g"
    )
    conn.execute("ANALYZE outbox_dlq")
    statement = AdminSql(NAMES).render("admin_dlq_list", match="admin_dlq_match")
    cases = {
        "outbox_dlq_reason_idx": DlqFilter(reason="rejected"),
        "outbox_dlq_queue_reason_idx": DlqFilter(queue="q3", reason="invalid_row"),
    }
    for index, where in cases.items():
        params = asdict(where.match()) | {"limit": 51, "before": None}
        assert index in _plan_json(conn, statement, params), (index, where)
        params["before"] = 30000  # a later page: the same index
        assert index in _plan_json(conn, statement, params), (index, where)
    # The positive control: without a filter the primary key is the way.
    params = asdict(DlqFilter().match()) | {"limit": 51, "before": None}
    assert "outbox_dlq_pkey" in _plan_json(conn, statement, params)


def test_a_statement_past_the_time_limit_asks_for_a_narrower_filter(dsn: str, conn: Conn) -> None:
    fail(conn, 1)
    conn.execute(
        "INSERT INTO outbox_dlq (original_id, queue, payload, deliveries_count, created_at, "
        "failed_at, failure_reason, last_exception) SELECT g, 'q', convert_to(repeat('y', 200), "
        "'UTF8'), 1, now(), now(), 'rejected', repeat('z', 200) FROM generate_series(1, 200000) g"
    )
    with client(dsn) as http:  # the positive control: within the limit
        assert http.get("/dlq?text=nowhere-at-all").status_code == 200
    with client(dsn, statement_timeout=0.001) as http:
        got = http.get("/dlq?text=nowhere-at-all")
        live = http.get("/overview/live", headers={"hx-request": "true"})
    assert got.status_code == 503
    assert "narrow the filter" in got.text
    assert live.status_code == 503
    assert 'id="live-error"' in live.text


def test_a_big_payload_is_shown_cut_and_offered_whole(dsn: str, conn: Conn) -> None:
    big = "A" * 200_000
    (row,) = fail(conn, 1, payload=big, headers='{"content-type": "text/html"}')
    (small,) = fail(conn, 1, payload="tiny", headers='{"content-type": "text/plain"}')
    with client(dsn) as http:
        page = http.get(f"/dlq/{row}").text
        whole = http.get(f"/dlq/{row}/payload")
        short = http.get(f"/dlq/{small}").text
        assert http.get("/dlq/999999/payload").status_code == 404
    assert "Only the first 65,536 bytes are shown" in page
    assert "200,000 bytes" in page
    assert len(page) < 100_000
    assert 'id="payload-cut"' not in short  # the positive control
    assert whole.content == big.encode()
    assert whole.headers["content-type"] == "application/octet-stream"
    assert whole.headers["content-disposition"].startswith("attachment;")
    assert whole.headers["x-content-type-options"] == "nosniff"


# -- 8. IPv6 ---------------------------------------------------------------------------------


def test_listens_on_the_ipv6_loopback() -> None:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    with listen("[::1]", 0) as sock:
        assert sock.family == socket.AF_INET6
        with socket.create_connection(sock.getsockname()[:2], timeout=5):
            pass
    with listen("127.0.0.1", 0) as sock:
        assert sock.family == socket.AF_INET
    with pytest.raises(ConfigurationError, match="does not resolve"):
        listen("no-such-host.invalid", 0)


# -- 10, 12, 13, 14, 15: sessions, tokens, live parts ----------------------------------------


def test_only_login_itself_and_static_files_are_open(dsn: str) -> None:
    with client(dsn, tokens=tokens()) as http:
        assert http.get("/login").status_code == 200
        assert http.get("/static/console.css").status_code == 200
        assert http.get("/loginx").status_code == 401
        assert http.get("/login-and-more/x").status_code == 401


def test_a_live_part_says_why_it_stopped(dsn: str) -> None:
    live = {"hx-request": "true", **HTML}
    with client(dsn, tokens=tokens()) as http:
        got = http.get("/overview/live", headers=live)
        assert got.status_code == 401
        assert 'id="live-error"' in got.text
        assert "<html" not in got.text
        page = http.get("/login").text
    assert '"[2345].."' in page  # htmx swaps error answers in
    secret = "host=127.0.0.1 port=1 user=postgres password=hunter2-secret dbname=x"
    with client(secret) as http:
        got = http.get("/farm/live", headers=live)
        assert got.status_code == 200  # the farm page's database part is optional
        got = http.get("/overview/live", headers=live)
    assert got.status_code == 503
    assert 'id="live-error"' in got.text
    assert "cannot be reached" in got.text
    assert "hunter2" not in got.text


def test_a_bearer_client_needs_no_csrf_token(dsn: str, conn: Conn) -> None:
    (row,) = fail(conn, 1)
    form = {"action": "purge", "scope": "ids", "ids": str(row)}
    with client(dsn, tokens=tokens()) as http:
        http.post("/login", data={"token": TOKEN})
        assert http.post("/dlq/preview", data=form).status_code == 403  # a cookie needs it
        http.cookies.clear()
        bearer = {"authorization": "Bearer " + TOKEN}
        dry = http.post("/dlq/preview", data=form, headers=bearer)
        assert dry.status_code == 200
        plan = dry.text.split('name="plan" value="')[1].split('"')[0]
        done = http.post("/dlq/run", data={"plan": plan, "confirm": "yes"}, headers=bearer)
        assert done.status_code == 200
    assert dlq_ids(conn) == set()


def test_token_file_lines_are_split_only_when_unambiguous(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    colon = "abc:def:0123456789abcdef"
    path.write_text(
        "\n".join(
            [
                "alice:" + TOKEN,
                "ci.bot-2:" + "c" * 20,
                colon,  # two colons: a bare token, whole
                "bad name:" + "d" * 20,  # not a name: a bare token, whole
            ]
        )
        + "\n"
    )
    with pytest.raises(ConfigurationError, match="given twice"):
        Tokens.load(str(path))  # two bare tokens are both named `token`
    path.write_text(f"alice:{TOKEN}\nci.bot-2:{'c' * 20}\n{colon}\n")
    loaded = Tokens.load(str(path))
    assert loaded.by_name == {"alice": TOKEN, "ci.bot-2": "c" * 20, "token": colon}
    assert loaded.who(colon) == "token"
    assert loaded.who("\u00e9" * 20) is None  # any text is compared, none raises


def test_logging_out_revokes_the_session_cookie(dsn: str) -> None:
    with client(dsn, tokens=tokens()) as http:
        http.post("/login", data={"token": TOKEN})
        saved = http.cookies["outbox_farm_console"]
        page = http.get("/dlq")
        assert page.status_code == 200
        http.post("/logout", data={"csrf": csrf_of(page.text)})
        assert http.get("/dlq").status_code == 401
        http.cookies.set("outbox_farm_console", saved)  # a copy of the cookie, replayed
        assert http.get("/dlq").status_code == 401
        http.post("/login", data={"token": TOKEN})  # the positive control: a new session
        assert http.get("/dlq").status_code == 200
