"""The console over HTTP (Starlette's TestClient, a real database): who may do what, what a
page shows and never shows, and what replay and purge do."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from outbox_farm.cli import main
from outbox_farm.console.render import Chart, StoredException
from outbox_farm.console.security import COOKIE, Tokens
from outbox_farm.console.telemetry import Point, Sampler, parse_metrics
from tests.acceptance.test_cli import run
from tests.console.console_kit import (
    EXCEPTION,
    TOKEN,
    Conn,
    client,
    csrf_of,
    dlq_ids,
    fail,
    tokens,
)
from tests.steps import wait_for

HTML = {"accept": "text/html"}


def preview(http: Any, csrf: str, **form: Any) -> Any:
    return http.post("/dlq/preview", data={"csrf": csrf, **form})


def confirm(http: Any, html: str, **extra: str) -> Any:
    """Submit the confirmation form of a dry-run page, as its button does."""
    form = re.search(r'<form method="post" action="/dlq/run".*?</form>', html, re.DOTALL)
    assert form is not None, html
    fields: dict[str, Any] = {}
    for name, value in re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)"', form[0]):
        fields.setdefault(name, []).append(value)
    fields.update({"confirm": "yes", **extra})
    return http.post("/dlq/run", data=fields)


# -- access ----------------------------------------------------------------------------------


def test_loopback_serves_every_page_and_sets_a_strict_session_cookie(dsn: str, conn: Conn) -> None:
    (row,) = fail(conn, 1)
    with client(dsn) as http:
        for path in ("/", "/overview/live", "/dlq", f"/dlq/{row}", "/farm", "/farm/live"):
            got = http.get(path)
            assert got.status_code == 200, (path, got.text)
            assert "default-src 'self'" in got.headers["content-security-policy"]
        assert "set-cookie" not in http.get("/").headers  # the session is kept
    with client(dsn) as http:
        cookie = http.get("/").headers["set-cookie"].lower()
    assert cookie.startswith(COOKIE)
    assert "httponly" in cookie
    assert "samesite=strict" in cookie


def test_a_foreign_host_name_is_refused_without_a_token(dsn: str) -> None:
    """DNS rebinding: a page of another site whose name resolves to 127.0.0.1."""
    with client(dsn) as http:
        assert http.get("/", headers={"host": "evil.example:9465"}).status_code == 400
        assert http.get("/", headers={"host": "localhost:9465"}).status_code == 200
        assert http.get("/", headers={"host": "[::1]:9465"}).status_code == 200
    with client(dsn, tokens=tokens()) as http:  # a token protects it: any name will do
        bearer = {"authorization": "Bearer " + TOKEN, "host": "console.internal:9465"}
        assert http.get("/", headers=bearer).status_code == 200


def test_tokens_are_required_on_every_request_when_configured(dsn: str) -> None:
    with client(dsn, tokens=tokens()) as http:
        assert http.get("/dlq").status_code == 401
        assert http.get("/overview/live").status_code == 401
        to_login = http.get("/dlq?queue=a", headers=HTML, follow_redirects=False)
        assert to_login.status_code == 303
        assert to_login.headers["location"] == "/login?next=/dlq%3Fqueue%3Da"
        assert http.get("/login").status_code == 200  # the form itself is open
        bad = {"authorization": "Bearer " + TOKEN[:-1] + "x"}
        assert http.get("/dlq", headers=bad).status_code == 401
        good = {"authorization": "Bearer " + TOKEN}
        page = http.get("/dlq", headers=good)
        assert page.status_code == 200
        assert "alice" in page.text  # who is shown
        # The login form: a wrong token is refused, the right one sets the session cookie.
        refused = http.post("/login", data={"token": "not-the-token-at-all", "next": "/dlq"})
        assert refused.status_code == 401
        assert "not valid" in refused.text
        assert http.get("/dlq").status_code == 401
        logged = http.post(
            "/login", data={"token": TOKEN, "next": "//evil.example/"}, follow_redirects=False
        )
        assert logged.status_code == 303
        assert logged.headers["location"] == "/"  # never another site
        cookie = logged.headers["set-cookie"].lower()
        assert "httponly" in cookie
        assert "samesite=strict" in cookie
        assert http.get("/dlq").status_code == 200


def test_a_session_cookie_of_another_process_or_forged_is_refused(dsn: str) -> None:
    with client(dsn, tokens=tokens()) as http:
        http.post("/login", data={"token": TOKEN})
        forged = http.cookies[COOKIE].rsplit(".", 1)[0] + ".AAAA"
    with client(dsn, tokens=tokens()) as other:
        other.cookies[COOKIE] = forged
        assert other.get("/dlq").status_code == 401


def test_token_files(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# the on-call rota\nalice: " + TOKEN + "\n\n" + "b" * 20 + "\n")
    assert Tokens.load(str(path)).by_name == {"alice": TOKEN, "token": "b" * 20}
    assert Tokens.load(str(path)).who(TOKEN) == "alice"
    assert Tokens.load(str(path)).who(TOKEN + "x") is None
    path.write_text("bob:short\n")
    with pytest.raises(ValueError, match="shorter than 16 characters"):
        Tokens.load(str(path))
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no token"):
        Tokens.load(str(path))


# -- the command -----------------------------------------------------------------------------


def test_a_non_loopback_bind_without_a_token_refuses_to_start(dsn: str, tmp_path: Path) -> None:
    refused = CliRunner().invoke(main, ["console", "--dsn", dsn, "--bind", "0.0.0.0:9465"])
    assert refused.exit_code == 2, refused.output
    assert "--token-file" in refused.output
    assert "bind 127.0.0.1" in refused.output
    # Through the environment, as a container sets it, the same.
    refused = CliRunner().invoke(
        main, ["console", "--dsn", dsn], env={"OUTBOX_FARM_CONSOLE_BIND": "[::]:9465"}
    )
    assert refused.exit_code == 2, refused.output
    short = tmp_path / "tokens"
    short.write_text("alice:short\n")
    bad = CliRunner().invoke(
        main, ["console", "--dsn", dsn, "--bind", "0.0.0.0:0", "--token-file", str(short)]
    )
    assert bad.exit_code == 2, bad.output
    assert "shorter than 16" in bad.output


def test_a_port_in_use_is_one_line_saying_what_to_do(dsn: str) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run("console", "--dsn", dsn, "--bind", f"127.0.0.1:{port}", timeout=60)
    assert result.returncode == 1, result.stderr
    assert "cannot listen" in result.stderr
    assert "pick a free port" in result.stderr


def test_without_the_extra_the_command_says_what_to_install() -> None:
    probe = (
        # A DSN, so that the command gets past its options (no server answers on port 1: the
        # missing package must be said before any connection is tried).
        "import sys; sys.modules['uvicorn'] = None\n"
        "sys.argv = ['outbox-farm', 'console', '--dsn', 'host=127.0.0.1 port=1 dbname=none']\n"
        "from outbox_farm.cli import main; main()"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 1
    assert "pip install 'outbox-farm[console]'" in result.stderr, result.stderr


def test_importing_the_cli_imports_no_web_stack() -> None:
    probe = (
        "import sys, outbox_farm.cli\n"
        "print(sorted(m for m in ('starlette', 'jinja2', 'uvicorn', 'multipart') "
        "if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


# -- CSRF and read-only ----------------------------------------------------------------------


def test_every_post_needs_the_csrf_token_of_its_session(dsn: str, conn: Conn) -> None:
    (row,) = fail(conn, 1)
    with client(dsn) as http:
        csrf = csrf_of(http.get(f"/dlq/{row}").text)
        form = {"action": "purge", "scope": "ids", "ids": str(row)}
        assert http.post("/dlq/preview", data=form).status_code == 403
        assert preview(http, csrf[:-2] + "xx", **form).status_code == 403
        assert (
            http.post("/dlq/run", data={**form, "confirm": "yes", "upto": row}).status_code == 403
        )
        cross = http.post(
            "/dlq/preview",
            data={"csrf": csrf, **form},
            headers={"origin": "http://evil.example"},
        )
        assert cross.status_code == 403
        assert dlq_ids(conn) == {row}  # none of those changed anything
        assert preview(http, csrf, **form).status_code == 200  # the positive control
    with client(dsn) as other:  # another session's token is no good here
        other.get("/")
        assert preview(other, csrf, **form).status_code == 403


def test_read_only_has_no_action_and_refuses_every_post(dsn: str, conn: Conn) -> None:
    (row,) = fail(conn, 1)
    with client(dsn) as http:  # the positive control: the buttons are there
        assert 'action="/dlq/preview"' in http.get(f"/dlq/{row}").text
    with client(dsn, read_only=True) as http:
        for path in ("/dlq", f"/dlq/{row}", "/"):
            text = http.get(path).text
            assert "/dlq/preview" not in text, path
            assert "/dlq/run" not in text, path
            assert "read-only" in text
        csrf = "no page of a read-only console holds one"
        for path in ("/dlq/preview", "/dlq/run"):
            got = http.post(path, data={"csrf": csrf, "action": "purge", "scope": "ids"})
            assert got.status_code == 403
            assert "read-only" in got.text
    assert dlq_ids(conn) == {row}


# -- what pages show -------------------------------------------------------------------------


XSS = "<script>window.__xss = 1</script>"


def test_payloads_headers_and_exceptions_are_escaped(dsn: str, conn: Conn) -> None:
    (row,) = fail(
        conn,
        1,
        queue="q<img src=x onerror=alert(1)>",
        payload=XSS,
        headers='{"content-type": "text/plain", "correlation_id": "<b>c</b>", "<i>k</i>": "'
        + XSS.replace('"', '\\"')
        + '"}',
        exception=XSS + "\nTraceback (innermost frames last):\n"
        '  File "<script>f.py</script>", line 1, in <module>\n    x()',
    )
    with client(dsn) as http:
        for path in (f"/dlq/{row}", "/dlq", "/", "/dlq?text=" + XSS):
            text = http.get(path).text
            for raw in ("<script>window", "<img src=x", "<b>c</b>", "<i>k</i>"):
                assert raw not in text, (path, raw)
        page = http.get(f"/dlq/{row}").text
    assert "&lt;script&gt;window.__xss = 1&lt;/script&gt;" in page
    assert "&lt;b&gt;c&lt;/b&gt;" in page


def test_no_dsn_is_ever_shown(outbox_templates: Any, dsn: str, conn: Conn) -> None:
    fail(conn, 1)
    with client(dsn) as http:
        for path in ("/", "/dlq", "/farm"):
            text = http.get(path).text
            assert dsn not in text
            assert "dbname" not in text
            assert "host=" not in text
            assert "postgresql://" not in text
    # An unreachable server: the page says so, naming neither it nor its password.
    secret = "host=127.0.0.1 port=1 user=postgres password=hunter2-secret dbname=x"
    with client(secret) as http:
        got = http.get("/dlq")
        assert got.status_code == 503
        assert "cannot be reached" in got.text
        assert "hunter2" not in got.text
        assert "port=1" not in got.text


def test_a_row_page_decodes_the_payload_and_splits_the_exception(dsn: str, conn: Conn) -> None:
    (row,) = fail(conn, 1, payload='{"order": 7, "lines": [1, 2]}')
    with client(dsn) as http:
        page = http.get(f"/dlq/{row}").text
        assert http.get("/dlq/999999").status_code == 404
    assert "json, 29 bytes" in page
    assert "&#34;lines&#34;: [" in page  # pretty-printed
    assert 'id="correlation" class="mono">corr-1' in page
    assert "/srv/app/orders.py" in page
    assert "price = PRICES[order.sku]" in page
    parsed = StoredException.parse(EXCEPTION)
    assert parsed is not None
    assert parsed.text == "KeyError('sku')"
    assert [(f.file, f.line, f.function) for f in parsed.frames] == [
        ("/srv/app/orders.py", 41, "handle")
    ]


def test_the_list_pages_by_keyset_and_says_n_of_m(dsn: str, conn: Conn) -> None:
    ids = fail(conn, 120, queue="a")
    fail(conn, 3, queue="b", reason="rejected")
    with client(dsn, page_size=50) as http:
        first = http.get("/dlq?queue=a").text
        assert "Rows 1–50 of 120" in first
        older = re.search(r'href="/dlq\?([^"]+)" id="older"', first)
        assert older is not None
        second = http.get("/dlq?" + older[1].replace("&amp;", "&")).text
        assert "Rows 51–100 of 120" in second
        assert f'data-id="{ids[119 - 50]}"' in second
        assert f'data-id="{ids[119]}"' not in second
        assert "Rows 4–6" not in http.get("/dlq?reason=rejected").text
        assert "Rows 1–3 of 3" in http.get("/dlq?reason=rejected").text
        searched = http.get("/dlq?text=" + "ORDERS.PY&queue=b").text
        assert "Rows 1–3 matching" in searched  # a text search is not counted: its rows are
        assert "is not counted" in searched
        bad = http.get("/dlq?since=yesterday-ish")
        assert bad.status_code == 400
        assert "neither a duration" in bad.text
    with client(dsn, count_cap=10) as http:
        assert "of about" in http.get("/dlq").text  # past the cap: the planner's estimate


def test_overview_and_farm_say_when_the_farm_is_unreachable(dsn: str, conn: Conn) -> None:
    conn.execute(
        "INSERT INTO outbox (queue, payload) SELECT 'mail', 'x' FROM generate_series(1, 4)"
    )
    fail(conn, 2, queue="mail", reason="rejected")
    url = "http://127.0.0.1:1/metrics"
    with client(dsn, metrics_url=url) as http:
        overview = wait_for(
            lambda: (
                (got := http.get("/")).status_code == 200
                and "Farm metrics unavailable" in got.text
                and got
            ),
            "the sampler's first (failed) reading",
            30,
        )
        farm = http.get("/farm").text
    assert 'data-queue="mail"' in overview.text
    assert 'class="ready" data-value="4"' in overview.text
    assert "Farm metrics unavailable" in overview.text
    assert url in overview.text
    assert "Farm unreachable" in farm
    assert 'id="xmin"' in farm
    assert "No open snapshot" in farm


METRICS = """\
# TYPE outbox_farm_acked_total counter
outbox_farm_acked_total{queue="q"} %(acked)s
# TYPE outbox_farm_retried_total counter
outbox_farm_retried_total{queue="q"} 2
# TYPE outbox_farm_delivery_lag_seconds histogram
outbox_farm_delivery_lag_seconds_bucket{le="0.1",queue="q"} %(acked)s
outbox_farm_delivery_lag_seconds_bucket{le="+Inf",queue="q"} %(acked)s
outbox_farm_delivery_lag_seconds_count{queue="q"} %(acked)s
outbox_farm_delivery_lag_seconds_sum{queue="q"} 1
# TYPE outbox_farm_processes gauge
outbox_farm_processes 2
# TYPE outbox_farm_worker_restarts_total counter
outbox_farm_worker_restarts_total{reason="crash"} 3
# TYPE outbox_farm_relay_up gauge
outbox_farm_relay_up{target="kafka"} 0
# TYPE outbox_farm_queue_stalled gauge
outbox_farm_queue_stalled{queue="idle_one"} 0
"""


def test_readings_give_rates_farm_figures_and_a_chart() -> None:
    first = parse_metrics(METRICS % {"acked": 10}, at=100.0, wall=1000.0)
    assert first.processes == 2
    assert first.restarts == {"crash": 3}
    assert first.relays_up == {"kafka": False}
    assert first.queues == {"q", "idle_one"}
    sampler = Sampler("http://farm/metrics", 5.0)
    sampler.add(first)
    sampler.add(parse_metrics(METRICS % {"acked": 60}, at=105.0, wall=1005.0))
    view = sampler.view()
    assert view.queues["q"].acked == pytest.approx(10.0)
    assert view.queues["q"].lag_p99 is not None
    assert view.queues["q"].lag_p99 <= 0.1
    assert view.points == [Point(1005.0, 10.0, 0.0, 0.0)]
    chart = Chart.of([Point(0, 1, 0, 0), Point(5, 3, 1, 0)])
    assert chart is not None
    assert chart.top == 3
    assert chart.lines[0].points == "0.0,79.3 600.0,2.0"


# -- actions ---------------------------------------------------------------------------------


def outbox_rows(conn: Conn) -> list[tuple[str, dict[str, Any], bool]]:
    return [
        (str(q), dict(h), bool(due))
        for q, h, due in conn.execute(
            "SELECT queue, headers, next_attempt_at <= now() FROM outbox ORDER BY id"
        ).fetchall()
    ]


def test_replay_one_row_after_a_dry_run_and_log_who_did_it(
    dsn: str, conn: Conn, caplog: pytest.LogCaptureFixture
) -> None:
    row, other = fail(conn, 2)
    with client(dsn) as http, caplog.at_level(logging.INFO, logger="outbox_farm.console"):
        csrf = csrf_of(http.get(f"/dlq/{row}").text)
        dry = preview(http, csrf, action="replay", scope="ids", ids=str(row))
        assert dry.status_code == 200
        assert 'id="dry-run" data-rows="1"' in dry.text
        assert dlq_ids(conn) == {row, other}  # the dry run changed nothing
        unconfirmed = confirm(http, dry.text, confirm="no")
        assert unconfirmed.status_code == 400
        assert dlq_ids(conn) == {row, other}
        done = confirm(http, dry.text)
        assert done.status_code == 200
        assert 'data-rows="1"' in done.text
    assert dlq_ids(conn) == {other}
    ((queue, headers, due),) = outbox_rows(conn)
    assert queue == "orders"
    assert headers["replayed_from"] == row
    assert due
    (record,) = [r for r in caplog.records if getattr(r, "event", "") == "console_action"]
    assert record.__dict__["who"] == "loopback"
    assert record.__dict__["action"] == "replay"
    assert record.__dict__["rows"] == 1
    assert record.__dict__["selection"] == f"ids {row}"


def test_replay_a_selection_to_another_queue_later(dsn: str, conn: Conn) -> None:
    a, b, c = fail(conn, 3)
    with client(dsn, tokens=tokens()) as http:
        http.post("/login", data={"token": TOKEN})
        csrf = csrf_of(http.get("/dlq").text)
        dry = preview(http, csrf, action="replay", scope="ids", ids=[str(a), str(c)])
        assert 'data-rows="2"' in dry.text
        done = confirm(http, dry.text, to_queue="orders_v2", delay="1h")
        assert "to queue orders_v2, due in 1h" in done.text
    assert dlq_ids(conn) == {b}
    assert [(q, due) for q, _, due in outbox_rows(conn)] == [("orders_v2", False)] * 2


def test_purge_the_whole_filter_bounded_by_what_the_dry_run_counted(
    dsn: str, conn: Conn, caplog: pytest.LogCaptureFixture
) -> None:
    junk = fail(conn, 5, queue="junk", reason="rejected")
    keep = fail(conn, 2, queue="junk", reason="max_deliveries") + fail(conn, 2, queue="orders")
    with client(dsn, tokens=tokens()) as http, caplog.at_level(logging.INFO):
        http.post("/login", data={"token": TOKEN})
        csrf = csrf_of(http.get("/dlq?queue=junk&reason=rejected").text)
        dry = preview(http, csrf, action="purge", scope="filter", queue="junk", reason="rejected")
        assert 'data-rows="5"' in dry.text
        late = fail(conn, 1, queue="junk", reason="rejected")  # failed after the dry run
        done = confirm(http, dry.text)
        assert 'data-rows="5"' in done.text
    assert dlq_ids(conn) == set(keep) | set(late)
    assert not set(junk) & dlq_ids(conn)
    (record,) = [r for r in caplog.records if getattr(r, "event", "") == "console_action"]
    assert record.__dict__["who"] == "alice"
    assert record.__dict__["rows"] == 5
    assert record.__dict__["selection"] == "queue='junk' reason='rejected'"


def test_the_whole_dlq_needs_its_own_confirmation(dsn: str, conn: Conn) -> None:
    rows = fail(conn, 3)
    with client(dsn) as http:
        csrf = csrf_of(http.get("/dlq").text)
        dry = preview(http, csrf, action="purge", scope="filter")
        assert "EVERY row of the DLQ" in dry.text
        refused = confirm(http, dry.text)
        assert refused.status_code == 400
        assert "every row" in refused.text
        assert dlq_ids(conn) == set(rows)
        assert 'data-rows="3"' in confirm(http, dry.text, all_rows="yes").text
    assert dlq_ids(conn) == set()
