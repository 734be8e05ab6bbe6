"""The import rules in pyproject.toml cover the whole package, and they bite.

`lint-imports` (CI) enforces the contracts; these tests keep the contracts honest: a module
outside every layer would be free to import anything, and a contract that cannot fail guards
nothing.
"""

from __future__ import annotations

import pkgutil
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import outbox_farm

ROOT = Path(__file__).resolve().parents[2]
LINT = "import sys, importlinter.cli as c; sys.exit(c.lint_imports_command())"


def contracts() -> list[dict[str, object]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    found: list[dict[str, object]] = config["tool"]["importlinter"]["contracts"]
    return found


def layered() -> set[str]:
    [layers] = [c["layers"] for c in contracts() if c["type"] == "layers"]
    assert isinstance(layers, list)
    return {name.strip() for layer in layers for name in layer.split("|")}


def test_every_module_of_the_package_is_in_a_layer() -> None:
    names = layered()
    modules = [info.name for info in pkgutil.walk_packages(outbox_farm.__path__, "outbox_farm.")]
    assert len(modules) > 100
    outside = [
        module
        for module in modules
        if not any(module == name or module.startswith(name + ".") for name in names)
        and not any(name.startswith(module + ".") for name in names)  # a wing's package
    ]
    assert outside == []


def test_a_relay_importing_the_metrics_registry_breaks_a_contract(tmp_path: Path) -> None:
    """A copy of the package with one forbidden import added: lint-imports must refuse it."""
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "outbox_farm", copy / "outbox_farm")
    runner = copy / "outbox_farm" / "relay" / "runner.py"
    runner.write_text(
        runner.read_text(encoding="utf-8") + "\nfrom ..metrics import relay_metrics  # noqa\n",
        encoding="utf-8",
    )
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    done = subprocess.run(
        [sys.executable, "-c", LINT, "--config", "pyproject.toml"],
        cwd=copy,
        env={"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0, done.stdout
    assert "Relays reach metrics only through the observers BROKEN" in done.stdout
