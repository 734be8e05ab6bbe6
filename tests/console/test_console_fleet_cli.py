"""`outbox-farm console --fleet APP` as a process: without --database it serves the whole set
(an overview at /, each database under /db/NAME/), with --database NAME one database as
before; and in a browser, the picker on every page goes to the same page of another database.
"""

from __future__ import annotations

import contextlib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox_farm.testing.databases import Templates
from tests.console.console_kit import NAMES, RunningConsole, chromium, console_process, fail

APP = """\
import os

from outbox_farm import Farm, Message
from outbox_farm.fleet import Fleet

farm = Farm()


@farm.handler("orders")
def orders(msg: Message) -> None:
    pass


fleet = Fleet(farm, databases=os.environ["CONSOLEFLEET_SET"])
"""


@pytest.fixture
def fleet_dir(tmp_path: Path, outbox_templates: Templates) -> Iterator[tuple[Path, dict[str, str]]]:
    """The app module and its set of two migrated tenant databases, `alpha` and `beta`."""
    (tmp_path / "consolefleet.py").write_text(APP)
    with contextlib.ExitStack() as stack:
        made = [stack.enter_context(outbox_templates.database(NAMES)) for _ in range(2)]
        tenants = {"alpha": made[0], "beta": made[1]}
        lines = ["[databases]", *(f'{k} = "{v}"' for k, v in tenants.items())]
        (tmp_path / "databases.toml").write_text("\n".join(lines) + "\n")
        yield tmp_path, tenants


@contextlib.contextmanager
def fleet_console(folder: Path, home: str, *args: str) -> Iterator[RunningConsole]:
    """`outbox-farm console --fleet consolefleet:fleet` run from `folder` (where its app is)."""
    with console_process(
        folder,
        home,
        "--fleet",
        "consolefleet:fleet",
        "--metrics-url",
        "",
        *args,
        name=f"console-{len(list(folder.glob('console-*.log')))}",
        cwd=folder,
        env={"CONSOLEFLEET_SET": str(folder / "databases.toml")},
    ) as running:
        yield running


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def test_without_database_the_console_serves_the_set_and_with_one_that_database(
    fleet_dir: tuple[Path, dict[str, str]], dsn: str
) -> None:
    folder, _ = fleet_dir
    with fleet_console(folder, dsn) as console:
        assert status(console.url + "/") == 200
        assert status(console.url + "/db/alpha/dlq") == 200
        assert status(console.url + "/db/gamma/") == 404
        assert status(console.url + "/dlq") == 404  # a database's pages are under /db/NAME/
        assert "console over the fleet's set: 2 database(s)" in console.log()
    with fleet_console(folder, dsn, "--database", "all") as console:
        assert status(console.url + "/db/beta/") == 200
    with fleet_console(folder, dsn, "--database", "beta") as console:
        assert status(console.url + "/dlq") == 200
        assert status(console.url + "/db/beta/") == 404


@pytest.fixture
def browser() -> Iterator[Any]:
    with chromium() as launched:
        yield launched


@pytest.mark.slow
def test_the_picker_goes_to_the_same_page_of_another_database(
    browser: Any, fleet_dir: tuple[Path, dict[str, str]], dsn: str
) -> None:
    folder, tenants = fleet_dir
    with psycopg.connect(tenants["beta"], autocommit=True) as conn:
        fail(conn, 4, queue="beta-orders")
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(30_000)
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    try:
        with fleet_console(folder, dsn) as console:
            page.goto(console.url + "/")
            assert page.locator('tr[data-database="alpha"]').count() == 1
            assert (
                page.locator('tr[data-database="beta"] td.dlq').get_attribute("data-value") == "4"
            )
            page.click('tr[data-database="alpha"] th a')
            page.wait_for_url("**/db/alpha/")
            page.click('nav a[href="/db/alpha/dlq"]')
            page.wait_for_url("**/db/alpha/dlq")
            assert page.locator("#current-database").inner_text() == "alpha"
            assert page.locator("#dlq-count").get_attribute("data-total") == "0"
            # Choosing another database in the picker goes there (console.js submits it).
            page.select_option("#picker-select", "beta")
            page.wait_for_url("**/db/beta/dlq")
            assert page.locator("#current-database").inner_text() == "beta"
            assert page.locator("#dlq-count").get_attribute("data-total") == "4"
            page.screenshot(path=str(folder / "picker.png"), full_page=True)
            page.click("#all-databases")
            page.wait_for_url(console.url + "/")
    finally:
        context.close()
    assert not dialogs, dialogs
