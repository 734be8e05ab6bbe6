"""Every code sample of the documentation (README.md and docs/) runs, or says why it does not.

Each page runs in a working directory of its own against a fresh, migrated database of its own
(`OUTBOX_FARM_DSN` for the shell and for the Python blocks, which read it as a reader would
from their environment), its blocks in page order: Python blocks in one interpreter per page,
shell blocks in bash, console transcripts line by line (answering `y` to a confirmation).
How a block is marked: `tests/docs/blocks.py`. A block that fails fails its page's test, naming
the block's line; a Python or shell block with no mark that it is not run is run, and a block
with no language at all is refused.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs.blocks import (
    CONSOLE,
    PYTHON,
    ROOT,
    SHELL,
    TEXT,
    Block,
    blocks,
    console_commands,
    pages,
)

TIMEOUT = 120.0  # seconds for one block (the demo publishes and delivers 20,000 messages)
BIN = Path(sys.executable).parent


def _env(workdir: Path, dsn: str, server_dsn: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_FARM_")}
    env.update(
        OUTBOX_FARM_DSN=dsn,
        OUTBOX_FARM_TEST_DSN=server_dsn,  # what the test kit's examples use
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=os.pathsep.join([str(workdir), str(ROOT / "examples")]),
        TMPDIR=str(workdir),
    )
    return env


class Interpreter:
    """The page's Python session (`tests/docs/interpreter.py` in a subprocess)."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.log = (workdir / ".python.log").open("w+")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("interpreter.py"))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            cwd=workdir,
            env=env,
            text=True,
        )

    def run(self, block: Block) -> None:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        start = self.log.tell()
        self.proc.stdin.write(json.dumps({"code": block.code, "name": block.where}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], TIMEOUT)
        if not ready:
            pytest.fail(f"{block.where}: no answer within {TIMEOUT:g}s", pytrace=False)
        line = self.proc.stdout.readline()
        if not line:
            pytest.fail(f"{block.where}: the interpreter died: {self._output(start)}")
        answer = json.loads(line)
        if not answer["ok"]:
            pytest.fail(
                f"{block.where} failed:\n{answer['error']}\n{self._output(start)}", pytrace=False
            )

    def _output(self, start: int) -> str:
        self.log.flush()
        self.log.seek(start)
        text = self.log.read()
        self.log.seek(0, os.SEEK_END)
        return text[-4000:]

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        self.log.close()


def _shell(block: Block, command: str, workdir: Path, env: dict[str, str]) -> None:
    ran = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", command],
        cwd=workdir,
        env=env,
        input="y\n" * 20,  # a confirmation is answered yes, as the transcript shows
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    if ran.returncode != 0:
        pytest.fail(
            f"{block.where}: `{command}` exited {ran.returncode}\n"
            f"stdout:\n{ran.stdout[-3000:]}\nstderr:\n{ran.stderr[-3000:]}",
            pytrace=False,
        )


def _example(block: Block, workdir: Path, env: dict[str, str]) -> None:
    """A test module, collected by a pytest of its own with the plugin found by its entry
    point, as a user's suite would."""
    name = block.marks["example"].replace("-", "_")
    folder = workdir / f"example_{name}"
    folder.mkdir()
    (folder / f"test_{name}.py").write_text(block.code, encoding="utf-8")
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(folder)],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    if ran.returncode != 0 or " passed" not in ran.stdout:
        pytest.fail(f"{block.where}: the example failed:\n{ran.stdout}{ran.stderr}", pytrace=False)


def _write(block: Block, workdir: Path) -> None:
    path = workdir / block.marks["file"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(block.code, encoding="utf-8")
    if path.suffix == ".py":  # a package a later block imports
        for parent in path.relative_to(workdir).parents:
            if str(parent) != ".":
                (workdir / parent / "__init__.py").touch()


def _pages_with_samples() -> Iterator[Path]:
    for page in pages():
        if any(b.runnable or "file" in b.marks for b in blocks(page)):
            yield page


def _id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", list(_pages_with_samples()), ids=_id)
def test_every_sample_of_the_page_runs(
    page: Path, dsn: str, server_dsn: str, tmp_path: Path
) -> None:
    env = _env(tmp_path, dsn, server_dsn)
    interpreter: Interpreter | None = None
    try:
        for block in blocks(page):
            if block.not_run_reason is not None:
                continue
            if "file" in block.marks:
                _write(block, tmp_path)
            elif "example" in block.marks:
                _example(block, tmp_path, env)
            elif block.language in PYTHON:
                interpreter = interpreter or Interpreter(tmp_path, env)
                interpreter.run(block)
            elif block.language in SHELL:
                _shell(block, block.code, tmp_path, env)
            elif block.language in CONSOLE:
                for command in console_commands(block.code):
                    _shell(block, command, tmp_path, env)
    finally:
        if interpreter is not None:
            interpreter.close()


def test_every_block_is_labelled_and_every_mark_says_why() -> None:
    problems = []
    for page in pages():
        for block in blocks(page):
            if block.language not in PYTHON | SHELL | CONSOLE | TEXT:
                problems.append(
                    f"{block.where}: fence language {block.language or '(none)'!r}: label it "
                    f"(python, sh, console run; {', '.join(sorted(TEXT))} are text)"
                )
            if "not run" in block.marks and len(block.marks["not run"]) < 10:
                problems.append(f"{block.where}: `not run` needs its reason")
            if "ci" in block.marks and page.name != "README.md":
                problems.append(f"{block.where}: `ci:` marks belong to the README (.ci/run)")
            if block.language in CONSOLE and not console_commands(block.code):
                problems.append(f"{block.where}: a console block with no `$ ` command")
    assert not problems, "\n".join(problems)


def test_the_first_app_is_the_example_app_the_image_runs() -> None:
    """The tutorial's app is `examples/myapp/outbox.py`, which the test kit's examples and the
    container image use: one app, so that what the reader builds is what they deploy."""
    page = ROOT / "docs" / "getting-started" / "first-app.md"
    (written,) = [b for b in blocks(page) if b.marks.get("file") == "myapp/outbox.py"]
    shipped = (ROOT / "examples" / "myapp" / "outbox.py").read_text(encoding="utf-8")
    assert written.code == shipped[shipped.index("from outbox_farm") :]


def census() -> tuple[dict[str, int], list[str], int]:
    """How the blocks run, how many do not and why, and how many are text:
    `python -m tests.docs.test_samples`."""
    run: dict[str, int] = {}
    not_run: list[str] = []
    text = 0
    for page in pages():
        for block in blocks(page):
            reason = block.not_run_reason
            if reason is not None:
                not_run.append(f"{block.where}: {reason}")
                continue
            if "file" in block.marks:
                kind = "written as a file"
            elif "example" in block.marks:
                kind = "pytest module"
            elif block.runnable:
                kind = block.language
            else:
                text += 1
                continue
            run[kind] = run.get(kind, 0) + 1
    return run, not_run, text


if __name__ == "__main__":
    ran, reasons, text = census()
    print(f"run: {sum(ran.values())} ({', '.join(f'{n} {k}' for k, n in sorted(ran.items()))})")
    print(f"not run: {len(reasons)}")
    for line in reasons:
        print(f"  {line}")
    print(f"text (output, YAML, ...): {text}")
