"""Loading the user's application (`module:attribute`), and loading it again in a new worker.

The arbiter imports the app once at start, to refuse to begin when it cannot be imported and to
learn its tables and queues. Workers forked later import the app's own modules afresh from the
files on disk (unless `--preload`), so `kill -HUP` rolls out a deploy the way gunicorn does
without preload: the old workers keep the old code until they drain, their replacements run the
new. Installed libraries (outbox_farm itself included) are not re-imported; upgrading them
needs a restart of the farm.
"""

from __future__ import annotations

import importlib
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable
from pathlib import Path

from ..chores.farm_code import remember
from ..errors import AppImportError
from ..farm import Farm
from ..fleet.fleet import Fleet

App = Farm | Fleet

# Where installed code lives: modules from here are libraries, never the app's own code.
_OURS = __name__.partition(".")[0]  # outbox_farm itself: never imported afresh
_LIBRARY_ROOTS = tuple(
    str(Path(p).resolve())
    for p in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)


def load_farm(path: str) -> App:
    """Import `module:attribute` (attribute defaults to `farm`) and check it is a usable Farm
    (or Fleet of farms)."""
    module_name, _, attribute = path.partition(":")
    attribute = attribute or "farm"
    if not module_name or not all(part.isidentifier() for part in module_name.split(".")):
        raise AppImportError(f"app path {path!r} is not of the form 'package.module:farm'")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise AppImportError(
                f"cannot import {module_name!r}: no module named {exc.name!r} "
                f"(run from the project directory, or check PYTHONPATH)"
            ) from None
        raise AppImportError(_failed(module_name, exc)) from None
    except Exception as exc:
        raise AppImportError(_failed(module_name, exc)) from None
    try:
        farm = getattr(module, attribute)
    except AttributeError:
        raise AppImportError(f"module {module_name!r} has no attribute {attribute!r}") from None
    if not isinstance(farm, Farm | Fleet):
        raise AppImportError(
            f"{path!r} is a {type(farm).__name__}, not an outbox_farm.Farm (nor a Fleet)"
        )
    if not farm.handlers:
        raise AppImportError(f"{path!r} has no handlers: register one with @farm.handler(queue)")
    # Now, not when a worker reports it: a worker forked from a preloaded app runs this code,
    # whatever the files on disk say by then.
    remember(farm.handlers.values())
    return farm


def _failed(module_name: str, exc: BaseException) -> str:
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    at = f" at {where.filename}:{where.lineno}" if where else ""
    return f"importing {module_name!r} raised {type(exc).__name__}: {exc}{at}"


def _is_library(module: object) -> bool:
    file = getattr(module, "__file__", None)
    if not file:
        return True  # built-in or namespace package: nothing on disk to read again
    return str(Path(file).resolve()).startswith(_LIBRARY_ROOTS)


class AppLoader:
    """The app at `path`, with `adjust` applied to every Farm loaded (CLI overrides such as
    `--concurrency`).

    `load()` runs in the arbiter and records which modules are the app's own: those the import
    added, minus installed libraries, plus the app's top-level package wherever it lives.
    `reload()` runs in a freshly forked worker: it forgets those modules and imports them again.
    """

    def __init__(self, path: str, adjust: Callable[[App], App] = lambda farm: farm) -> None:
        self.path = path
        self.adjust = adjust
        self.modules: frozenset[str] = frozenset()

    def load(self) -> App:
        before = set(sys.modules)
        farm = self.adjust(load_farm(self.path))
        top = self.path.partition(":")[0].split(".")[0]
        self.modules = frozenset(
            name
            for name in set(sys.modules) - before
            if name == top
            or name.startswith(top + ".")
            or not (_is_library(sys.modules[name]) or name.partition(".")[0] == _OURS)
        )
        return farm

    def reload(self) -> App:
        for name in self.modules:
            sys.modules.pop(name, None)
        importlib.invalidate_caches()
        return self.adjust(load_farm(self.path))

    def sources(self) -> dict[Path, float]:
        """Every `.py` file in the directories of the app's modules, with its mtime: what
        `--reload` watches (new files in those directories count as a change too)."""
        folders = set()
        for name in self.modules:
            file = getattr(sys.modules.get(name), "__file__", None)
            if file:
                folders.add(Path(file).parent)
        found: dict[Path, float] = {}
        for folder in folders:
            for source in folder.glob("*.py"):
                try:
                    found[source] = source.stat().st_mtime
                except FileNotFoundError:
                    continue
        return found
