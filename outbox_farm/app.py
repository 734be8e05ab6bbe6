"""Loading the user's application (`module:attribute`) once, in the arbiter, before forking."""

from __future__ import annotations

import importlib
import os
import sys
import traceback

from .errors import AppImportError
from .farm import Farm


def load_farm(path: str) -> Farm:
    """Import `module:attribute` (attribute defaults to `farm`) and check it is a usable Farm."""
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
    if not isinstance(farm, Farm):
        raise AppImportError(f"{path!r} is a {type(farm).__name__}, not an outbox_farm.Farm")
    if not farm.handlers:
        raise AppImportError(f"{path!r} has no handlers: register one with @farm.handler(queue)")
    return farm


def _failed(module_name: str, exc: BaseException) -> str:
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    at = f" at {where.filename}:{where.lineno}" if where else ""
    return f"importing {module_name!r} raised {type(exc).__name__}: {exc}{at}"
