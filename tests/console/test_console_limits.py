"""What the console takes and keeps: bodies capped before anyone is known, thousands of ticked
rows, a cookie per console, a farm naming thousands of queues, a Python 3.11 traceback."""

from __future__ import annotations

import asyncio
import http.cookiejar
import re
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from outbox_farm.console.telemetry import Sampler
from outbox_farm.console.views import SEEN_FOR, Recent
from tests.console.console_kit import (
    TOKEN,
    Conn,
    client,
    console_process,
    csrf_of,
    dlq_ids,
    fail,
    tokens,
)
from tests.console.slow_farm import body, fake_farm
from tests.console.test_console_http import HTML, confirm, preview
from tests.steps import wait_for

HEALTHY = b'{"status": "ok", "problems": []}'


# -- 9. bodies are capped before authentication ----------------------------------------------


def test_a_large_body_is_refused_before_anyone_is_known(dsn: str) -> None:
    with client(dsn, tokens=tokens()) as http:
        big = {"token": (None, TOKEN), "junk": ("junk.bin", b"x" * (2 << 20))}
        refused = http.post("/login", files=big)
        assert refused.status_code == 413
        assert "request body over 16,384 bytes refused" in refused.text

        def chunks() -> Iterator[bytes]:  # no Content-Length: capped as it is read
            yield b"token=" + TOKEN.encode() + b"&junk="
            for _ in range(64):
                yield b"x" * 4096

        chunked = http.post(
            "/login",
            content=chunks(),
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
        assert chunked.status_code == 413
        assert "alice" not in http.get("/", headers=HTML).text
        # The positive control: the login form itself, small, logs in.
        assert http.post("/login", data={"token": TOKEN}).status_code == 200
        assert http.get("/", headers=HTML).status_code == 200


# -- 11. thousands of ticked rows ------------------------------------------------------------


def test_thousands_of_ticked_rows_are_previewed_and_more_than_the_limit_is_said(
    dsn: str, conn: Conn
) -> None:
    rows = fail(conn, 2000, queue="junk")
    with client(dsn, tokens=tokens()) as http:
        http.post("/login", data={"token": TOKEN})
        csrf = csrf_of(http.get("/dlq").text)
        dry = preview(http, csrf, action="purge", scope="ids", ids=[str(r) for r in rows])
        assert dry.status_code == 200
        assert 'data-rows="2000"' in dry.text
        for ticked in (10_001, 20_000):  # past the limit, and past the form's fields
            ids = [str(i) for i in range(1, ticked + 1)]
            too_many = preview(http, csrf, action="purge", scope="ids", ids=ids)
            assert too_many.status_code == 400
            assert "at most 10,000 rows can be ticked at once" in too_many.text
            assert "Purge all matching" in too_many.text
        assert 'data-rows="2000"' in confirm(http, dry.text).text
    assert dlq_ids(conn) == set()


# -- 10. a cookie per console ----------------------------------------------------------------


def test_two_consoles_on_one_host_keep_their_own_sessions(
    tmp_path: Path, dsn: str, conn: Conn
) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_text(f"alice:{TOKEN}\n")
    args = ("--token-file", str(token_file), "--metrics-url", "")
    jar = http.cookiejar.CookieJar()  # one cookie jar, as a browser keeps one
    browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    with (
        console_process(tmp_path, dsn, *args, name="one") as one,
        console_process(tmp_path, dsn, *args, name="two") as two,
    ):
        for console in (one, two):
            form = urllib.parse.urlencode({"token": TOKEN}).encode()
            with browser.open(console.url + "/login", data=form, timeout=30) as answer:
                assert answer.status == 200  # the overview, after the login's redirect
        assert len({cookie.name for cookie in jar}) == 2, list(jar)
        for console in (one, two):
            request = urllib.request.Request(console.url + "/", headers=HTML)
            with browser.open(request, timeout=30) as answer:
                assert answer.url == console.url + "/"  # not sent to /login
                assert "Overview" in answer.read().decode()


# -- 12. a Python 3.11 traceback's marker line -----------------------------------------------


def test_a_traceback_marker_line_is_no_stray_box(dsn: str, conn: Conn) -> None:
    exception = (
        "KeyError('sku')\nTraceback (innermost frames last):\n"
        '  File "/srv/app/orders.py", line 41, in handle\n'
        "    price = PRICES[order.sku] + tax(order)\n"
        "            ~~~~~~^^^^^^^^^^^\n"
        '  File "/srv/app/tax.py", line 7, in tax\n'
        "    return RATES[order.region]\n"
        "           ^^^^^^^^^^^^^^^^^^^\n"
        "An unexpected line of another writer"
    )
    (row,) = fail(conn, 1, exception=exception)
    with client(dsn) as http:
        page = http.get(f"/dlq/{row}").text
    boxes = re.findall(r'<pre class="exception"[^>]*>(.*?)</pre>', page, re.DOTALL)
    assert boxes == ["KeyError(&#39;sku&#39;)", "An unexpected line of another writer"]
    assert "orders.py" in page
    assert "return RATES[order.region]" in page  # both frames in the table
    assert "^^^" not in page


# -- 8. a farm that names thousands of queues ------------------------------------------------


def _metrics(queues: int, acked: int, long_name: bool = False) -> bytes:
    lines = [f'outbox_farm_acked_total{{queue="q{i}"}} {acked}' for i in range(queues)]
    if long_name:
        lines.append(f'outbox_farm_acked_total{{queue="{"n" * 900_000}"}} 1')
    return ("\n".join(lines) + "\n").encode()


def test_thousands_of_queue_names_cost_a_bounded_page_and_two_readings(
    dsn: str, conn: Conn
) -> None:
    answers = {
        "/metrics": body(200, _metrics(2000, 1, long_name=True)),
        "/healthz": body(200, HEALTHY),
    }
    with fake_farm(answers) as url:
        sampler = Sampler(url, 0.2, timeout=10.0)
        for acked in range(2, 6):
            asyncio.run(sampler.sample())
            answers["/metrics"] = body(200, _metrics(2000, acked, long_name=True))
        assert sampler.error is None
        assert len(sampler.readings) == 2  # not one per reading for 15 minutes
        assert len(sampler.points) == 3
        latest = sampler.readings[-1]
        assert len(latest.queues) == 2000  # the 900 KB label names no queue
        assert all(len(q) < 10 for q in latest.queues)
        fail(conn, 1, queue="q7")
        with client(dsn, metrics_url=url, sample_every=0.2, farm_timeout=10.0) as http:
            wait_for(
                lambda: "Farm metrics from" in http.get("/overview/live").text,
                "two readings of the farm",
                60,
            )
            began = time.monotonic()
            page = http.get("/").text
            took = time.monotonic() - began
    assert took < 30, took  # 20 idle queues read, not 2,000
    assert page.count("<tr data-queue=") == 21  # q7, with rows, and 20 idle ones
    assert 'data-queue="q7"' in page
    assert "And 1,979 more queue(s) without rows" in page
    assert "nnnnnnnnnn" not in page


def test_a_drained_queue_is_remembered_for_a_while_then_forgotten() -> None:
    recent = Recent()
    assert recent.note({"a", "b"}, 0.0) == {"a", "b"}
    assert recent.note({"b"}, SEEN_FOR - 1) == {"a", "b"}
    assert recent.note(set(), SEEN_FOR + 1) == {"b"}
    assert recent.note(set(), 2 * SEEN_FOR) == set()
