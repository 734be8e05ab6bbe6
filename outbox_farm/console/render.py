"""What the templates need beyond the admin API's values: a stored exception split into its
repr and frames, the headers worth pointing at, numbers and ages for people, and the chart.

Pure functions of their inputs, so the pages' logic is tested without a browser. Nothing
here escapes anything: the templates do, always (Jinja2's autoescape).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson

from ..outcome import FRAMES_HEADER
from .telemetry import Point

# The header names under which producers keep a correlation id (ours writes the first).
CORRELATION_HEADERS = ("correlation_id", "correlation-id", "x-correlation-id", "traceparent")
_FRAME = re.compile(r'^  File "(?P<file>.*)", line (?P<line>\d+), in (?P<func>.*)$')
# Python 3.11 on underlines the failing part of a frame's code with a line of ~ and ^: it
# lines up with the code only in the traceback's own monospace text, so the table drops it.
_MARKER = re.compile(r"^ +[~^][~^ ]*$")


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str
    code: str


@dataclass(frozen=True)
class StoredException:
    """A DLQ row's `last_exception`: `repr(exc)` and, when the farm kept them, the innermost
    frames of its traceback (`outcome.describe_exception` wrote it)."""

    text: str
    frames: list[Frame]
    rest: str  # frame text that is not in the standard form (another writer's row)

    @classmethod
    def parse(cls, stored: str | None) -> StoredException | None:
        if not stored:
            return None
        text, header, tail = stored.partition(FRAMES_HEADER)
        if not header:
            return cls(stored, [], "")
        frames: list[Frame] = []
        rest: list[str] = []
        lines = tail.splitlines()
        i = 0
        while i < len(lines):
            found = _FRAME.match(lines[i])
            if found is None:
                rest.append(lines[i])
                i += 1
                continue
            code = ""
            if i + 1 < len(lines) and lines[i + 1].startswith("    "):
                code, i = lines[i + 1].strip(), i + 1
                if i + 1 < len(lines) and _MARKER.match(lines[i + 1]):
                    i += 1
            frames.append(Frame(found["file"], int(found["line"]), found["func"], code))
            i += 1
        return cls(text, frames, "\n".join(rest))


def correlation(headers: dict[str, Any]) -> tuple[str, str] | None:
    """(header name, value) of the row's correlation id, if it has one."""
    for name in CORRELATION_HEADERS:
        if name in headers:
            return name, str(headers[name])
    return None


def pretty_json(value: Any) -> str:
    return orjson.dumps(
        value, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS
    ).decode()


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h" if seconds < 172800 else f"{seconds / 86400:.1f}d"


def number(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"


def when(at: datetime | None) -> str:
    """`at` in UTC, the zone of every page; as given when UTC is out of the years 1 to 9999
    (0001-01-01T00:00+05:00 is in year 0 in UTC)."""
    if at is None:
        return "-"
    try:
        return at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, ValueError):
        return at.isoformat()


@dataclass(frozen=True)
class Line:
    name: str
    points: str  # the SVG polyline's points attribute
    last: float


@dataclass(frozen=True)
class Chart:
    """A small SVG line chart of rates, drawn by the template: coordinates only."""

    width: int
    height: int
    top: float  # the value at the top edge
    lines: list[Line]
    span: float  # seconds from the first point to the last

    @classmethod
    def of(cls, points: Sequence[Point], width: int = 600, height: int = 120) -> Chart | None:
        if len(points) < 2:
            return None
        first, last = points[0].wall, points[-1].wall
        span = max(last - first, 1e-6)
        series = {
            "acked/s": [p.acked for p in points],
            "retries/s": [p.retried for p in points],
            "terminal/s": [p.terminal for p in points],
        }
        top = max(max(values) for values in series.values()) or 1.0
        lines = []
        for name, values in series.items():
            coords = (
                f"{(p.wall - first) / span * width:.1f},{height - v / top * (height - 4) - 2:.1f}"
                for p, v in zip(points, values, strict=True)
            )
            lines.append(Line(name, " ".join(coords), values[-1]))
        return cls(width, height, top, lines, span)
