"""The README's "Testing your handlers" examples, run as a user runs them: each block written
to a test file and collected by a pytest of its own, with the plugin found through its entry
point, against `examples/myapp`. A README example that stops working fails here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def block(name: str) -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    found = re.findall(
        rf"^<!-- example: {name} -->\n```python\n(.*?)^```$", text, re.MULTILINE | re.DOTALL
    )
    assert len(found) == 1, f"README.md has {len(found)} blocks marked example: {name}"
    return str(found[0])


@pytest.mark.parametrize("name", ["testing-drain", "testing-recorder"])
def test_the_readme_example_passes_as_written(name: str, server_dsn: str, tmp_path: Path) -> None:
    (tmp_path / f"test_{name.replace('-', '_')}.py").write_text(block(name), encoding="utf-8")
    env = {
        **os.environ,
        "OUTBOX_FARM_TEST_DSN": server_dsn,
        "PYTHONPATH": str(ROOT / "examples"),
    }
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout
