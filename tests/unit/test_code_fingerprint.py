"""The fingerprint of a queue's handler (`chores.farm_code`): the code that was imported, not
the file on disk later; constants of code without source; a relay's target and settings."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from outbox_farm import Farm
from outbox_farm.chores.farm_code import fingerprint
from outbox_farm.handler import HandlerSpec
from outbox_farm.prefork.app import load_farm
from outbox_farm.relay import RabbitMQ

APP = """\
from outbox_farm import Farm

farm = Farm()


@farm.handler("q")
async def handle(message):
    return {body!r}
"""


def test_a_preloaded_handler_keeps_the_fingerprint_of_the_code_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker forked later from a preloaded app runs the code the arbiter imported: the file
    changed or removed since must not change what it reports."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    source = tmp_path / "preloaded_app.py"
    source.write_text(APP.format(body="old"))
    spec = load_farm("preloaded_app:farm").handlers["q"]
    imported = fingerprint(spec)

    source.write_text(APP.format(body="new, longer"))  # same lines, another text
    assert fingerprint(spec) == imported
    source.unlink()
    assert fingerprint(spec) == imported

    source.write_text(APP.format(body="new, longer"))  # control: importing it again sees it
    sys.modules.pop("preloaded_app")
    importlib.invalidate_caches()
    assert fingerprint(load_farm("preloaded_app:farm").handlers["q"]) != imported


def generated(topic: str) -> HandlerSpec:
    """A handler compiled from a string: no source to read, only its code object."""
    namespace: dict[str, Any] = {"__name__": "generated"}
    text = f"async def handle(message):\n    return ({topic!r}, message.body)\n"
    exec(compile(text, "<generated>", "exec"), namespace)
    farm = Farm()
    farm.handler("q")(namespace["handle"])
    return farm.handlers["q"]


def test_code_without_source_is_taken_with_its_constants() -> None:
    assert fingerprint(generated("orders")) == fingerprint(generated("orders"))
    assert fingerprint(generated("orders")) != fingerprint(generated("refunds"))


def relayed(url: str, exchange: str) -> HandlerSpec:
    farm = Farm()
    farm.relay("q", to=RabbitMQ(url, exchange=exchange, label="broker"))
    return farm.handlers["q"]


def test_a_relay_is_taken_with_its_target_but_not_its_password() -> None:
    first = relayed("amqp://app:first-secret@broker/", "orders")
    assert fingerprint(first) != fingerprint(relayed("amqp://app:first-secret@broker/", "refunds"))
    assert fingerprint(first) != fingerprint(relayed("amqp://app:first-secret@other/", "orders"))
    assert fingerprint(first) == fingerprint(relayed("amqp://app:rotated@broker/", "orders"))


SET_LITERAL = """
import sys
from outbox_farm import Farm
from outbox_farm.chores.farm_code import fingerprint

namespace = {"__name__": "generated"}
text = "async def handle(message):\\n    return message.body.decode() in {'a', 'b', 'c', 'd'}\\n"
exec(compile(text, "<generated>", "exec"), namespace)
farm = Farm()
farm.handler("q")(namespace["handle"])
sys.stdout.write(fingerprint(farm.handlers["q"]))
"""


def test_code_without_source_is_taken_alike_by_processes_that_hash_strings_differently() -> None:
    """A set literal is a frozenset constant, whose order follows the process's string hash."""

    def taken(seed: str) -> str:
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run(
            [sys.executable, "-c", SET_LITERAL], env=env, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr
        return run.stdout

    assert len({taken(str(seed)) for seed in range(1, 7)}) == 1
