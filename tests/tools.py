"""System packages some tests drive, found or reported the same way everywhere."""

from __future__ import annotations

import os

import pytest


def missing_tool(reason: str) -> None:
    """A test needs a system package the README's test block installs (promtool, libfaketime,
    a C compiler) and cannot find it: skipped on a developer's machine, saying what to install,
    but failed in CI, where a missing package means the README forgot a step."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; the README's test block must install it", pytrace=False)
    pytest.skip(reason)
