"""The images, checked offline (no Docker here): the base image recipe (the root Dockerfile) and
the example app layer on it (deploy/docker/example-app), parsed instruction by instruction.

The base holds outbox_farm and no app; the app layer adds an app's requirements, then its code,
and runs `outbox-farm start app:farm`, which the CLI must accept and whose farm must import. Each
build context holds what its Dockerfile copies and nothing the image does not need. The image
the manifests run is the app layer: `image_command` and `image_user` say what it runs, as whom.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib.util
import json
import re
import sys
from pathlib import Path

import click
import pytest

from outbox_farm import Farm
from outbox_farm.cli import main
from tests.docs.blocks import blocks

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "Dockerfile"
APP = ROOT / "deploy" / "docker" / "example-app"
APP_LAYER = APP / "Dockerfile"
GUIDE = ROOT / "docs" / "guides" / "deploying.md"
NON_ROOT = "10001:10001"

Instruction = tuple[str, str]


def instructions(path: Path) -> list[Instruction]:
    """A Dockerfile's instructions as (INSTRUCTION, rest), continuation lines joined."""
    return parse_instructions(path.read_text())


def parse_instructions(dockerfile: str) -> list[Instruction]:
    text = re.sub(r"\\\n", " ", dockerfile)
    lines = [line.strip() for line in text.splitlines()]
    return [
        (word.upper(), rest.strip())
        for word, _, rest in (line.partition(" ") for line in lines if line and line[0] != "#")
    ]


def stages(path: Path) -> list[tuple[str, list[Instruction]]]:
    """(name, instructions from its FROM on) of each stage; the name is "" when it has none."""
    found: list[tuple[str, list[Instruction]]] = []
    for word, rest in instructions(path):
        if word == "FROM":
            _, _, name = rest.partition(" AS ")
            found.append((name.strip(), []))
        if found:
            found[-1][1].append((word, rest))
    return found


def last(stage: list[Instruction], instruction: str) -> str | None:
    values = [rest for word, rest in stage if word == instruction]
    return values[-1] if values else None


def exec_form(stage: list[Instruction], instruction: str) -> list[str]:
    """The last `instruction` (ENTRYPOINT, CMD) of the stage, which must be in exec form: a shell
    form would make /bin/sh PID 1, and the shell does not pass SIGTERM on to the arbiter."""
    value = last(stage, instruction)
    assert value is not None, f"no {instruction}"
    argv = json.loads(value)
    assert isinstance(argv, list), f"{instruction} {value} is not in exec form"
    return [str(arg) for arg in argv]


def final(path: Path) -> list[Instruction]:
    return stages(path)[-1][1]


def image_command() -> tuple[list[str], list[str]]:
    """(ENTRYPOINT, CMD) of the app layer's image: its own CMD, the base's ENTRYPOINT (a layer
    that sets none inherits it; Docker resets CMD when a layer sets ENTRYPOINT)."""
    layer = final(APP_LAYER)
    assert last(layer, "ENTRYPOINT") is None, "the app layer keeps the base's entrypoint"
    return exec_form(final(BASE), "ENTRYPOINT"), exec_form(layer, "CMD")


def image_user() -> str:
    """The user the app layer's image runs as (`uid:gid`)."""
    user = last(final(APP_LAYER), "USER")
    assert user is not None
    return user


def exposed_ports() -> list[str]:
    return [rest for word, rest in final(BASE) + final(APP_LAYER) if word == "EXPOSE"]


def test_the_base_image_is_outbox_farm_alone_with_an_entrypoint_and_no_app() -> None:
    [(build, _), (name, base)] = stages(BASE)
    assert (build, name) == ("build", "base")
    copies = [rest for word, rest in base if word in {"COPY", "ADD"}]
    assert copies == ["--from=build /opt/venv /opt/venv"], "the base copies no app"
    assert exec_form(base, "ENTRYPOINT") == ["outbox-farm"]
    # Run alone, it lists the commands; `migrate` and `check` run from it as they are.
    assert exec_form(base, "CMD") == ["--help"]
    with pytest.raises(click.exceptions.Exit) as shown:
        main.make_context("outbox-farm", exec_form(base, "CMD"))
    assert shown.value.exit_code == 0
    assert (last(base, "WORKDIR"), last(base, "USER")) == ("/app", NON_ROOT)


def test_the_base_pins_its_dependencies_for_the_layers_on_it() -> None:
    [(_, build), (_, base)] = stages(BASE)
    env = " ".join(rest for word, rest in base if word == "ENV")
    [constraints] = re.findall(r"PIP_CONSTRAINT=(\S+)", env)
    runs = " ".join(rest for word, rest in build if word == "RUN")
    assert f"pip freeze --exclude outbox-farm > {constraints}" in runs
    assert constraints.startswith("/opt/venv/"), "copied into the base with the venv"


def test_the_app_layer_installs_the_requirements_then_copies_the_app_and_starts_it() -> None:
    [(_, layer)] = stages(APP_LAYER)
    args = dict(rest.split("=", 1) for word, rest in instructions(APP_LAYER) if word == "ARG")
    assert layer[0] == ("FROM", "${BASE_IMAGE}")
    # The base image's tag, as the root Dockerfile's header builds it.
    assert f"docker build -t {args['BASE_IMAGE']} ." in BASE.read_text()
    steps = [(word, rest) for word, rest in layer if word in {"COPY", "RUN", "USER"}]
    # Root only to install into the base's venv, the base's user again to run.
    assert steps == [
        ("USER", "root"),
        ("COPY", "requirements.txt ./"),
        ("RUN", "pip install --only-binary=:all: -r requirements.txt"),
        ("COPY", "app.py ./"),
        ("RUN", "python -m compileall -q /app"),
        ("USER", NON_ROOT),
    ]
    entrypoint, cmd = image_command()
    ctx = main.commands["start"].make_context("start", cmd[1:])
    assert (entrypoint, cmd[0], ctx.params["app"]) == (["outbox-farm"], "start", "app:farm")


def test_the_example_app_imports_as_start_imports_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """`app:farm` from the working directory /app, where the layer copied app.py."""
    module, _, attribute = image_command()[1][1].partition(":")
    spec = importlib.util.spec_from_file_location(module, APP / f"{module}.py")
    assert spec is not None
    assert spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, module, loaded)
    spec.loader.exec_module(loaded)
    farm = getattr(loaded, attribute)
    assert isinstance(farm, Farm)
    assert list(farm.handlers) == ["orders"]


def test_every_package_the_app_imports_is_in_its_requirements_or_the_base() -> None:
    tree = ast.parse((APP / "app.py").read_text())
    imported = {
        name.split(".")[0]
        for node in ast.walk(tree)
        for name in (
            [alias.name for alias in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and not node.level
            else []
        )
    }
    third_party = imported - set(sys.stdlib_module_names) - {"__future__", "outbox_farm"}
    required = {
        re.split(r"[<>=!~\[; ]", line.strip())[0].lower()
        for line in (APP / "requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert third_party, "the example has a dependency of its own: this test checks something"
    assert third_party <= required, third_party - required


def test_the_deploying_guide_shows_the_app_layer_as_it_ships() -> None:
    [shown] = [b.code for b in blocks(GUIDE) if b.language == "dockerfile"]
    assert parse_instructions(shown) == instructions(APP_LAYER)


# -- the build contexts -------------------------------------------------------------------------


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore leaves `path` out of the build context, by the part of Docker's
    rules these files use: the last pattern matching the path or one of its parent directories
    decides, and `!` puts it back."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        glob = pattern.removeprefix("!").strip("/")
        if any(
            fnmatch.fnmatchcase(c, glob) or fnmatch.fnmatchcase(c, f"*/{glob}") for c in candidates
        ):
            ignored = not keep
    return ignored


@pytest.mark.parametrize(
    ("dockerfile", "left_out"),
    [
        (BASE, [".venv", ".git", "tests/conftest.py", "outbox_farm/__pycache__/x.pyc", "deploy"]),
        (APP_LAYER, ["Dockerfile", "__pycache__/app.cpython-312.pyc", "notes.txt"]),
    ],
    ids=["base", "app-layer"],
)
def test_everything_the_dockerfile_copies_is_in_its_build_context(
    dockerfile: Path, left_out: list[str]
) -> None:
    context = dockerfile.parent
    patterns = [
        line.strip()
        for line in (context / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copied = [
        source
        for word, rest in instructions(dockerfile)
        if word == "COPY" and "--from=" not in rest
        for source in rest.split()[:-1]
    ]
    assert copied
    for source in copied:
        assert (context / source).exists(), source
        assert not _ignored(source, patterns), f".dockerignore leaves out {source}"
        for path in (context / source).rglob("*.py") if (context / source).is_dir() else []:
            assert not _ignored(str(path.relative_to(context)), patterns), path
    # The control: what the image does not need stays out.
    for path in left_out:
        assert _ignored(path, patterns), path
