"""Durations and points in time as an operator types them: `30d`, `12h`, `15m`, `45s`, or a time.

One parser for every option (`--older-than`, `--since`, `--delay`, `--dlq-retention`, ...), so
they all accept the same spellings and fail with the same message. A duration is turned into
seconds here and compared with the database clock (`now()`) by the SQL, never with this
machine's clock, which may be minutes off the server's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, tzinfo

from ..errors import ConfigurationError

UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$", re.IGNORECASE)
EXAMPLES = "e.g. 45s, 15m, 12h, 30d, 2w (a bare number is seconds)"
MAX_DURATION = 100 * 365.25 * 86400.0  # a century: longer is a typo, and past the timestamps


def parse_duration(text: str) -> float:
    """Seconds in `text` (`90d`, `1.5h`, `45`); ConfigurationError saying what is accepted."""
    match = _DURATION.match(text)
    if match is None:
        raise ConfigurationError(
            f"{text!r} is not a duration; write a number and a unit, {EXAMPLES}"
        )
    number, unit = match.groups()
    seconds = float(number) * UNITS[(unit or "s").lower()]
    if seconds > MAX_DURATION:
        raise ConfigurationError(f"{text!r} is longer than 100 years; {EXAMPLES}")
    return seconds


@dataclass(frozen=True)
class When:
    """A point in time: an absolute time, or so many seconds before the database's now()."""

    at: datetime | None = None
    ago: float | None = None

    @classmethod
    def parse(cls, text: str, naive: tzinfo | None = None) -> When:
        """`2h` (two hours before now, database clock, at most 100 years) or an ISO-8601 time
        of the years 1 to 9999; a time without a zone is in `naive` (None: this machine's
        local time, as the CLI reads it; the console passes UTC, the zone its pages show)."""
        if _DURATION.match(text):
            return cls(ago=parse_duration(text))
        try:
            at = datetime.fromisoformat(text.strip())
            if at.tzinfo is None:
                at = at.replace(tzinfo=naive) if naive is not None else at.astimezone()
        except (ValueError, OverflowError):
            raise ConfigurationError(
                f"{text!r} is neither a duration ago ({EXAMPLES}) nor an ISO-8601 time of the "
                "years 1 to 9999 (e.g. 2024-05-01T12:00:00+00:00)"
            ) from None
        return cls(at=at)

    def describe(self) -> str:
        return self.at.isoformat() if self.at is not None else f"{self.ago:g}s ago"
