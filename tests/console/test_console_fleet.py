"""The console over a fleet's set of databases (real tenant databases, one unreachable): the
overview of them all, the picker, each database's pages under /db/NAME/, an unknown name a 404
naming the set (never a DSN), an action on one database touching that database only, and a
database added to the catalog appearing at the next reading of the set."""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from starlette.testclient import TestClient

from outbox_farm import Farm, Message
from outbox_farm.admin.queues import queue_state
from outbox_farm.console import ConsoleSettings, create_app
from outbox_farm.console.database import KEEP, Budget, Database
from outbox_farm.console.sets import DatabaseSet
from outbox_farm.fleet import Fleet
from outbox_farm.fleet.databases import Sources
from outbox_farm.testing.databases import Templates
from tests.console.console_kit import BASE, NAMES, TOKEN, csrf_of, dlq_ids, fail, tokens
from tests.steps import publish, wait_for

BROKEN = "host=127.0.0.1 port=1 dbname=nowhere user=nobody password=hunter2-secret"
CATALOG = "SELECT name, dsn FROM console_tenants ORDER BY name"


def _fleet(**given: Any) -> Fleet:
    farm = Farm()

    @farm.handler("orders")
    def orders(msg: Message) -> None:
        pass

    return Fleet(farm, **given)


@pytest.fixture
def tenants(outbox_templates: Templates) -> Iterator[dict[str, str]]:
    """Two migrated tenant databases, `alpha` and `beta`."""
    with contextlib.ExitStack() as stack:
        yield {
            name: stack.enter_context(outbox_templates.database(NAMES))
            for name in ("alpha", "beta")
        }


def write_set(folder: Path, databases: dict[str, str]) -> Path:
    lines = ["[databases]", *(f'{k} = "{v}"' for k, v in databases.items())]
    path = folder / "databases.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@contextlib.contextmanager
def fleet_client(fleet: Fleet, home: str, **given: Any) -> Iterator[TestClient]:
    databases = DatabaseSet(Sources(fleet.file, fleet.catalog, home), fleet.recheck)
    settings = ConsoleSettings(database=None, sets=databases, names=NAMES, **given)
    with TestClient(create_app(settings), base_url=BASE) as client:
        yield client


def row_of(html: str, name: str) -> str:
    found = re.search(rf'<tr data-database="{re.escape(name)}".*?</tr>', html, re.S)
    assert found, f"no line of {name} in the overview"
    return found.group(0)


def test_the_overview_shows_every_database_and_an_unreachable_one_by_name(
    tmp_path: Path, tenants: dict[str, str], dsn: str
) -> None:
    publish(tenants["beta"], 3, queue="orders")
    with psycopg.connect(tenants["alpha"], autocommit=True) as conn:
        fail(conn, 2)
    path = write_set(tmp_path, {**tenants, "broken": BROKEN})
    with fleet_client(_fleet(databases=path), dsn, database_timeout=3.0) as client:
        answer = client.get("/")
        assert answer.status_code == 200, answer.text
        html = answer.text
        assert 'id="databases"' in html
        beta = row_of(html, "beta")
        assert 'class="pending" data-value="3"' in beta
        assert 'href="/db/beta/"' in beta
        alpha = row_of(html, "alpha")
        assert 'class="dlq" data-value="2"' in alpha
        broken = row_of(html, "broken")
        assert 'class="unreachable"' in broken
        assert "not read: cannot be reached" in broken
        assert "1 not read: broken" in html
        assert "hunter2" not in html
        assert "port=1" not in html
        live = client.get("/all/live", headers={"HX-Request": "true"})
        assert live.status_code == 200
        assert "<html" not in live.text
        assert 'data-database="beta"' in live.text
        # The pages of a database that does not answer say so; the others still serve.
        assert client.get("/db/broken/").status_code == 503
        assert client.get("/db/alpha/dlq").status_code == 200


def test_each_database_has_its_pages_and_the_picker_goes_to_the_same_page_of_another(
    tmp_path: Path, tenants: dict[str, str], dsn: str
) -> None:
    with psycopg.connect(tenants["beta"], autocommit=True) as conn:
        fail(conn, 1, queue="beta-only")
    path = write_set(tmp_path, tenants)
    with fleet_client(_fleet(databases=path), dsn) as client:
        page = client.get("/db/alpha/dlq")
        assert page.status_code == 200
        assert 'id="current-database" data-database="alpha"' in page.text
        assert '<option value="beta" >beta</option>' in page.text
        assert 'name="page" value="dlq"' in page.text
        assert 'action="/db/alpha/dlq"' in page.text
        assert "beta-only" not in page.text
        moved = client.get("/pick?database=beta&page=dlq", follow_redirects=False)
        assert moved.status_code == 303
        assert moved.headers["location"] == "/db/beta/dlq"
        assert "beta-only" in client.get("/db/beta/dlq").text
        assert (
            client.get("/pick?database=beta&page=../x", follow_redirects=False).headers["location"]
            == "/db/beta/"
        )
        queue = client.get("/db/beta/queues/beta-only")
        assert queue.status_code == 200
        assert 'action="/db/beta/queues/preview"' in queue.text
        overview = client.get("/db/beta/")
        assert 'hx-get="/db/beta/overview/live"' in overview.text
        assert (
            client.get("/db/beta/overview/live", headers={"HX-Request": "true"}).status_code == 200
        )


@pytest.mark.parametrize("name", ["gamma", "alpha.x", "-x", "a" * 200, "%00", "..%2F..%2Fetc"])
def test_an_unknown_database_is_a_404_naming_the_set_never_a_dsn(
    tmp_path: Path, tenants: dict[str, str], dsn: str, name: str
) -> None:
    path = write_set(tmp_path, tenants)
    with fleet_client(_fleet(databases=path), dsn) as client:
        for url in (f"/db/{name}/", f"/db/{name}/dlq", f"/pick?database={name}&page=dlq"):
            answer = client.get(url, follow_redirects=False)
            assert answer.status_code == 404, (url, answer.status_code)
            assert "No such database" in answer.text
            assert 'href="/db/alpha/"' in answer.text
            assert 'href="/db/beta/"' in answer.text
            for secret in tenants.values():
                assert secret not in answer.text
            assert "host=" not in answer.text
            assert "dbname" not in answer.text
        posted = client.post(f"/db/{name}/dlq/run", data={"plan": "x"})
        assert posted.status_code in (403, 404)


def test_a_purge_on_one_database_touches_that_database_only(
    tmp_path: Path, tenants: dict[str, str], dsn: str
) -> None:
    conns = {n: psycopg.connect(d, autocommit=True) for n, d in tenants.items()}
    try:
        alpha_ids, beta_ids = fail(conns["alpha"], 3), fail(conns["beta"], 3)
        assert alpha_ids == beta_ids  # fresh databases: the same ids on both sides
        path = write_set(tmp_path, tenants)
        with fleet_client(_fleet(databases=path), dsn) as client:
            csrf = csrf_of(client.get("/db/beta/dlq").text)
            form = {"csrf": csrf, "action": "purge", "scope": "filter", "queue": "orders"}
            preview = client.post("/db/beta/dlq/preview", data=form)
            assert preview.status_code == 200, preview.text
            assert 'action="/db/beta/dlq/run"' in preview.text
            plan = re.search(r'name="plan" value="([^"]+)"', preview.text)
            assert plan
            run = {"csrf": csrf, "plan": plan.group(1), "confirm": "yes"}
            # The same confirmation posted to another database is not a plan of it.
            wrong = client.post("/db/alpha/dlq/run", data=run)
            assert wrong.status_code == 400
            assert "does not come from a dry run" in wrong.text
            assert dlq_ids(conns["alpha"]) == set(alpha_ids)
            done = client.post("/db/beta/dlq/run", data=run)
            assert done.status_code == 200, done.text
            assert 'href="/db/beta/dlq?queue=orders"' in done.text
        assert dlq_ids(conns["beta"]) == set()
        assert dlq_ids(conns["alpha"]) == set(alpha_ids)
    finally:
        for conn in conns.values():
            conn.close()


def test_read_only_holds_on_every_database_of_the_set(
    tmp_path: Path, tenants: dict[str, str], dsn: str
) -> None:
    path = write_set(tmp_path, tenants)
    with fleet_client(_fleet(databases=path), dsn, read_only=True) as client:
        page = client.get("/db/alpha/queues/orders")
        assert page.status_code == 200
        assert "pause-form" not in page.text  # no form to change anything
        csrf = "not-needed: refused before"
        for name in tenants:
            refused = client.post(
                f"/db/{name}/queues/preview",
                data={"csrf": csrf, "queue": "orders", "action": "pause"},
            )
            assert refused.status_code == 403
            assert "read-only" in refused.text


def test_a_database_added_to_the_catalog_shows_up_and_connections_stay_bounded(
    tenants: dict[str, str], dsn: str, conn: psycopg.Connection[Any]
) -> None:
    conn.execute("CREATE TABLE console_tenants (name text, dsn text)")
    conn.execute("INSERT INTO console_tenants VALUES ('alpha', %s)", [tenants["alpha"]])
    fleet = _fleet(catalog=CATALOG, recheck=0.5)
    with fleet_client(fleet, dsn) as client:
        assert client.get("/db/beta/").status_code == 404
        assert 'data-database="alpha"' in client.get("/").text
        conn.execute("INSERT INTO console_tenants VALUES ('beta', %s)", [tenants["beta"]])
        wait_for(
            lambda: client.get("/db/beta/").status_code == 200, "beta to be served from the catalog"
        )
        assert 'data-database="beta"' in client.get("/").text
        sets: DatabaseSet = client.app.state.sets  # type: ignore[attr-defined]
        assert sets.budget.idle <= KEEP
        conn.execute("DELETE FROM console_tenants WHERE name = 'alpha'")
        wait_for(lambda: client.get("/db/alpha/").status_code == 404, "alpha to leave the set")


def test_a_pause_on_one_database_pauses_its_queue_only_and_is_logged_with_it(
    tmp_path: Path, tenants: dict[str, str], dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_set(tmp_path, tenants)
    with (
        fleet_client(_fleet(databases=path), dsn) as client,
        caplog.at_level(logging.INFO, logger="outbox_farm.console"),
    ):
        csrf = csrf_of(client.get("/db/beta/queues/orders").text)
        form = {"csrf": csrf, "queue": "orders", "action": "pause", "reason": "beta only"}
        asked = client.post("/db/beta/queues/preview", data=form)
        assert asked.status_code == 200, asked.text
        assert 'action="/db/beta/queues/run"' in asked.text
        plan = re.search(r'name="plan" value="([^"]+)"', asked.text)
        assert plan
        run = {"csrf": csrf, "plan": plan.group(1), "confirm": "yes"}
        assert client.post("/db/alpha/queues/run", data=run).status_code == 400
        done = client.post("/db/beta/queues/run", data=run)
        assert done.status_code == 200, done.text
        assert 'href="/db/beta/queues/orders"' in done.text
    for name, paused in (("alpha", False), ("beta", True)):
        with psycopg.connect(tenants[name], autocommit=True) as conn:
            assert queue_state(conn, NAMES, "orders").paused is paused, name
    [logged] = [r for r in caplog.records if getattr(r, "event", "") == "console_action"]
    assert logged.database == "beta"  # type: ignore[attr-defined]
    assert "of database beta" in logged.getMessage()


def test_with_tokens_no_database_or_name_is_shown_before_login(
    tmp_path: Path, tenants: dict[str, str], dsn: str
) -> None:
    path = write_set(tmp_path, tenants)
    with fleet_client(_fleet(databases=path), dsn, tokens=tokens()) as client:
        for url in ("/", "/db/alpha/dlq", "/db/gamma/", "/pick?database=beta"):
            answer = client.get(url, headers={"Accept": "text/html"}, follow_redirects=False)
            assert answer.status_code == 303, url
            assert answer.headers["location"].startswith("/login?next=")
            assert "alpha" not in answer.text
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert client.get("/db/alpha/dlq", headers=bearer).status_code == 200
        assert client.get("/db/gamma/", headers=bearer).status_code == 404
        login = client.post("/login", data={"token": TOKEN, "next": "/db/beta/dlq"})
        assert login.status_code == 200
        assert str(login.url).endswith("/db/beta/dlq")


def test_idle_connections_are_kept_few_across_the_set_and_closed_when_idle_too_long(
    tenants: dict[str, str],
) -> None:
    budget = Budget(open=2, keep=1, idle_for=60.0)
    databases = [Database(url, name, budget=budget) for name, url in tenants.items()]
    for database in databases:
        with database.connection() as conn:
            conn.execute("SELECT 1")
    assert budget.idle == 1  # the first database's connection closed for the second's
    with databases[1].connection() as conn:  # taken back, not opened again
        assert conn.execute("SELECT 1").fetchone() == (1,)
    assert budget.sweep(now=time.monotonic() + 61.0) == 1
    assert budget.idle == 0
