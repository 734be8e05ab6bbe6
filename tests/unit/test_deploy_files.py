"""The systemd unit and the Procfile say what the CLI understands.

A variable the farm never reads is a setting silently ignored (the unit once set
PROMETHEUS_MULTIPROC_DIR, which the farm overrides with its own directory): every OUTBOX_FARM_*
variable these files set must be one a CLI option reads, and their command lines must parse.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from outbox_farm.cli import main

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "supervisor" / "outbox-farm.service"
PROCFILE = ROOT / "Procfile"
APP = "myapp.outbox:farm"


def commands(group: click.Group) -> Iterator[click.Command]:
    for command in group.commands.values():
        yield command
        if isinstance(command, click.Group):
            yield from commands(command)


def read_by_the_cli() -> set[str]:
    names: set[str] = set()
    for command in commands(main):
        for param in command.params:
            envvar = getattr(param, "envvar", None)
            names.update([envvar] if isinstance(envvar, str) else envvar or [])
    return names


def expanded_in(command: str) -> set[str]:
    """Variables the file's own command line expands (`${NAME}` or `${NAME:-default}`)."""
    return set(re.findall(r"\$\{(\w+)(?::-[^}]*)?\}", command))


def unit_lines(key: str) -> list[str]:
    return [
        line.partition("=")[2]
        for line in UNIT.read_text(encoding="utf-8").splitlines()
        if line.startswith(key + "=")
    ]


def parses(argv: list[str]) -> click.Context:
    """`argv` (after the program name) parsed by the real CLI, without running anything."""
    name, *rest = argv
    command = main.commands[name]
    return command.make_context(name, rest, resilient_parsing=False)


def test_the_unit_sets_only_variables_the_cli_reads() -> None:
    [exec_start] = unit_lines("ExecStart")
    known = read_by_the_cli() | expanded_in(exec_start)
    set_here = [line.partition("=")[0] for line in unit_lines("Environment")]
    assert set_here, "the unit sets no variable: this test checks nothing"
    assert [name for name in set_here if name not in known] == []


def test_the_unit_and_the_procfile_run_command_lines_the_cli_accepts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in [n for n in read_by_the_cli() if n.startswith("OUTBOX_FARM_")]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OUTBOX_FARM_DSN", "postgresql://localhost/app")
    [exec_start] = unit_lines("ExecStart")
    processes = dict(
        line.split(":", 1) for line in PROCFILE.read_text(encoding="utf-8").splitlines()
    )
    assert set(processes) == {"release", "worker"}
    lines = [exec_start, processes["worker"], *processes["release"].split("&&")]
    started = []
    for command in lines:
        text = re.sub(r"\$\{OUTBOX_FARM_APP(?::-[^}]*)?\}", APP, command)
        text = re.sub(r"\$\{(\w+):-([^}]*)\}", r"\2", text)
        program, *argv = shlex.split(text)
        assert program.endswith("outbox-farm")
        context = parses(argv)
        if argv[0] == "start":
            started.append(context.params["app"])
    assert started == [APP, APP]


def test_a_misspelt_option_would_fail_the_parse() -> None:
    with pytest.raises(click.UsageError):
        parses(["start", APP, "--log-fromat", "json"])
