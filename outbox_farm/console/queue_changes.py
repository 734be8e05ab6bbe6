"""What an operator asks of a queue on its page, checked: a pause (why, and for how long or
until when), a resume, limits (a rate such as `100/s`, a most running at once, a most running
of each fair key), the close of an open breaker; and the plan a confirmation page carries of it
(`plan`, `change_of`), signed by `queue_actions`.

A bad value is a ConfigurationError whose message says what to type instead; a rate's is
`parse_rate`'s own, so the console and `outbox-farm queue limit` refuse a rate in one voice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ..admin.durations import EXAMPLES, When
from ..admin.queues import QueueState
from ..errors import ConfigurationError
from ..limits import Limits, Rate, parse_rate

ACTIONS = ("pause", "resume", "limit", "close-breaker")
KIND = "queue"  # a plan of a queue's change: `/dlq/run` refuses it, `/queues/run` any other
MAX_REASON = 500  # characters of a pause's reason
MAX_RUNNING = 2**31 - 1  # the column's integer
# Echoed back to the form when refused.
FIELDS = ("reason", "until", "rate", "max_running", "key_max_running")


@dataclass(frozen=True)
class Change:
    """What the operator asked for, checked. `until` is a time given; `lasting` a duration
    from the confirmation (`lasting_text` as typed); neither: until resumed."""

    action: str
    queue: str
    reason: str | None = None
    until: datetime | None = None
    lasting: float | None = None
    lasting_text: str = ""
    limits: Limits = field(default_factory=Limits)

    def describe(self) -> str:
        """The change for the log: what, and its details."""
        if self.action == "pause":
            end = (
                f"until {self.until.isoformat()}"
                if self.until is not None
                else f"for {self.lasting_text}"
                if self.lasting is not None
                else "until resumed"
            )
            return f"pause {end}" + (f", reason {self.reason!r}" if self.reason else "")
        if self.action == "limit":
            return f"limit to {self.limits}" if self.limits else "clear the limits"
        if self.action == "close-breaker":
            return "close the breaker"
        return "resume"


def _until(text: str) -> tuple[datetime | None, float | None]:
    """(a time, None) or (None, seconds) from the pause's one field: `30m` lasts 30 minutes,
    `2026-11-28T18:00` ends then (UTC unless the time names its zone)."""
    if not text:
        return None, None
    try:
        point = When.parse(text, UTC)
    except ConfigurationError:
        raise ConfigurationError(
            f"pause for how long? {text[:40]!r} is neither a duration ({EXAMPLES}) nor an "
            "ISO-8601 time (e.g. 2026-11-28T18:00, UTC unless it names its zone)"
        ) from None
    if point.ago is not None:
        if point.ago <= 0:
            raise ConfigurationError(
                "a pause of no time is no pause: give a duration (e.g. 30m) or leave it empty"
            )
        return None, point.ago
    return point.at, None


def _most(text: str, asked: str) -> int | None:
    """A most running from its field: empty is none; `asked` is the question the refusal
    starts with, naming the field."""
    if not text:
        return None
    try:
        number = int(text)
    except ValueError:
        number = 0
    if not 1 <= number <= MAX_RUNNING:
        raise ConfigurationError(
            f"{asked} {text[:40]!r} is not a whole number from 1 to {MAX_RUNNING}; leave it "
            "empty for no such limit"
        )
    return number


def _limits(form: dict[str, str], clear: bool) -> Limits:
    if clear:
        return Limits()
    rate: Rate | None = None
    if form["rate"] and form["rate"].lower() != "none":
        try:
            rate = parse_rate(form["rate"])
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from None
    return Limits(
        rate,
        _most(form["max_running"], "at most how many running?"),
        _most(form["key_max_running"], "at most how many running of each fair key?"),
    )


def parse_change(action: str, queue: str, form: dict[str, str], clear: bool) -> Change:
    """The change asked for; ConfigurationError saying what to fix."""
    if action not in ACTIONS:
        raise ConfigurationError(
            f"unknown action {action!r}: pause, resume, limit or close-breaker"
        )
    if action == "pause":
        reason = form["reason"] or None
        if reason is not None and (len(reason) > MAX_REASON or "\x00" in reason):
            raise ConfigurationError(
                f"a reason is at most {MAX_REASON} characters, without NUL characters"
            )
        until, lasting = _until(form["until"])
        return Change(action, queue, reason, until, lasting, form["until"] if lasting else "")
    if action == "limit":
        return Change(action, queue, limits=_limits(form, clear))
    return Change(action, queue)


def iso(at: datetime | None) -> str | None:
    return at.isoformat() if at is not None else None


def plan(change: Change, seen: QueueState) -> dict[str, Any]:
    """The plan (JSON-able, to be signed) of `change`, shown against the controls `seen`."""
    rate = change.limits.rate
    return {
        "kind": KIND,
        "action": change.action,
        "queue": change.queue,
        "reason": change.reason,
        "until": iso(change.until),
        "lasting": change.lasting,
        "lasting_text": change.lasting_text,
        "rate": [rate.count, rate.seconds] if rate is not None else None,
        "max_running": change.limits.max_running,
        "key_max_running": change.limits.key_max_running,
        "seen": iso(seen.changed_at),
    }


def change_of(plan: dict[str, Any]) -> Change:
    """The change a plan was made for."""
    rate = Rate(int(plan["rate"][0]), float(plan["rate"][1])) if plan["rate"] else None
    until = datetime.fromisoformat(plan["until"]) if plan["until"] else None
    return Change(
        plan["action"],
        plan["queue"],
        plan["reason"],
        until,
        plan["lasting"],
        plan["lasting_text"],
        Limits(rate, plan["max_running"], plan["key_max_running"]),
    )


def unchanged(change: Change, state: QueueState) -> str | None:
    """Why `change` would change nothing of `state` (the page says so and offers no button)."""
    if change.action == "resume" and not state.paused:
        return f"queue {change.queue} is not paused: there is nothing to resume"
    if change.action == "limit" and change.limits == state.limits:
        return f"queue {change.queue} has these limits already ({state.limits})"
    if change.action == "close-breaker" and not state.breaker.open:
        return f"the breaker of queue {change.queue} is not open: there is nothing to close"
    return None


def typed(form: Any) -> dict[str, str]:
    return {name: str(form.get(name) or "").strip() for name in FIELDS}


def limits_form(limits: Limits) -> dict[str, str]:
    """The limits' form as it was filled for `limits`: what a refusal after the confirmation
    shows again, to be changed or sent as it is once the database allows it."""

    def text(most: int | None) -> str:
        return "" if most is None else str(most)

    return {
        "rate": "" if limits.rate is None else str(limits.rate),
        "max_running": text(limits.max_running),
        "key_max_running": text(limits.key_max_running),
    }
