"""The fenced code blocks of the documentation, and the marks that say how each one is run.

A mark is an HTML comment on the line right above the fence (several may be stacked):

- `<!-- not run: REASON -->`: shown, never run; the reason is required.
- `<!-- file: PATH -->`: written to PATH in the page's working directory, not run (a module
  later blocks import, a config file a command reads).
- `<!-- example: NAME -->` (Python): a test module, run by a pytest of its own.
- `<!-- ci: NAME -->` (README only): run verbatim by `.ci/run` on a clean copy of the tree.

Every other `python` block is executed, in page order, in one interpreter per page; every
`sh`/`bash` block runs in bash; a `console` block runs the lines after `$ `. A block in any
other language is text (output, YAML, SQL...), and a block with no language is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYTHON = {"python", "py"}
SHELL = {"sh", "bash", "shell"}
CONSOLE = {"console"}
TEXT = {
    "text",
    "yaml",
    "json",
    "sql",
    "ini",
    "toml",
    "dockerfile",
    "promql",
    "systemd",
    "procfile",
    "csv",
    "html",
    "markdown",
    "md",
}

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>[^\n`]*)$")
_MARK = re.compile(r"^\s*<!--\s*(?P<kind>not run|file|example|ci)\s*:\s*(?P<value>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    marks: dict[str, str]

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def runnable(self) -> bool:
        return self.language in PYTHON | SHELL | CONSOLE

    @property
    def not_run_reason(self) -> str | None:
        """Why this block is not run here (None: it is)."""
        if "not run" in self.marks:
            return self.marks["not run"]
        if "ci" in self.marks:
            return "run verbatim by .ci/run on a clean copy of the tree"
        if "file" in self.marks:
            return None
        return None


def pages() -> list[Path]:
    """README.md and every page of the site."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of `page`, in order, with their marks."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opened = _FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        fence, indent = opened["fence"], len(opened["indent"])
        language = opened["info"].strip().split(" ")[0].lower()
        marks: dict[str, str] = {}
        above = i - 1
        while above >= 0 and (mark := _MARK.match(lines[above])):
            marks.setdefault(mark["kind"], mark["value"])
            above -= 1
        body: list[str] = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != fence:
            line = lines[j]
            body.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
            j += 1
        code = "\n".join(body) + "\n"
        found.append(Block(page, i + 1, language, code, marks))
        i = j + 1
    return found


def console_commands(code: str) -> list[str]:
    """The commands of a console transcript: the lines after `$ ` (a trailing `\\` joins)."""
    commands: list[str] = []
    pending = ""
    for line in code.splitlines():
        if pending:
            pending += "\n" + line
        elif line.startswith("$ "):
            pending = line[2:]
        else:
            continue
        if not pending.endswith("\\"):
            commands.append(pending)
            pending = ""
    return commands
