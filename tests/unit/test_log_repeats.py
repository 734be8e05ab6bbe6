"""Retry log lines: one line per retry (its exception's type and first line), the frames on the
terminal line and at DEBUG, and a limit per queue and cause on repeated lines, with a count of
what it held back. No database: verdicts from the decision core, told to the log observer."""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest

from outbox_farm.cli.log_setup import JsonFormatter, TextFormatter
from outbox_farm.decision import Notes
from outbox_farm.message import Message
from outbox_farm.observe.logs import LogObserver
from outbox_farm.observe.repeats import Kind, RepeatLimit
from outbox_farm.outcome import FRAMES_HEADER, LINE_MAX, exception_line
from outbox_farm.retry import ConstantBackoff, NoRetry
from tests.steps import eventually
from tests.unit.test_decision import decide, message, spec

RETRY = spec(retry=ConstantBackoff(1.0))


def raised(text: str, cls: type[Exception] = ValueError) -> Exception:
    """An exception as a handler's raise leaves it: with a traceback."""
    try:
        raise cls(text)
    except Exception as exc:
        return exc


def failing(row: int = 42, queue: str = "q") -> Message:
    return message(id=row, queue=queue)


def tell(observer: LogObserver, msg: Message, notes: Notes) -> None:
    assert notes
    observer.noted(msg, notes)


def of(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == event]


@pytest.fixture
def info(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="outbox_farm")
    return caplog


def test_a_retry_is_one_line_naming_the_error_row_attempt_and_delay(
    info: pytest.LogCaptureFixture,
) -> None:
    msg = failing(row=7)
    tell(LogObserver(), msg, decide(RETRY, msg, raised("bad sku 9\nsecond line"))[1])
    (record,) = of(info, "retry")
    assert record.levelno == logging.WARNING
    text = record.getMessage()
    assert "\n" not in text
    assert "Traceback" not in text
    assert "queue q failed on row 7 (attempt 1); retrying in 1s: ValueError: bad sku 9" in text
    fields = {k: getattr(record, k) for k in ("row_id", "queue", "attempt", "delay", "error_type")}
    assert fields == {
        "row_id": 7,
        "queue": "q",
        "attempt": 1,
        "delay": 1.0,
        "error_type": "ValueError",
    }


def test_the_terminal_line_carries_the_frames_once(info: pytest.LogCaptureFixture) -> None:
    msg = failing()
    tell(LogObserver(), msg, decide(spec(retry=NoRetry()), msg, raised("bad sku"))[1])
    (record,) = of(info, "terminal")
    assert record.levelno == logging.ERROR
    text = record.getMessage()
    assert text.count(FRAMES_HEADER) == 1
    assert "in raised" in text
    assert (record.error_type, record.reason) == ("ValueError", "retry_terminal")  # type: ignore[attr-defined]


def test_repeated_errors_are_limited_per_queue_and_cause_and_counted(
    info: pytest.LogCaptureFixture,
) -> None:
    observer = LogObserver(burst=3, window=60.0)
    for row in range(10):  # one cause: the order's number is masked
        msg = failing(row=row)
        tell(observer, msg, decide(RETRY, msg, raised(f"order {row} not found"))[1])
    assert [r.row_id for r in of(info, "retry")] == [0, 1, 2]  # type: ignore[attr-defined]
    # Another queue, and another cause on the same queue, have limits of their own.
    other, timeout = failing(row=100, queue="other"), failing(row=101)
    tell(observer, other, decide(RETRY, other, raised("order 5 not found"))[1])
    tell(observer, timeout, decide(RETRY, timeout, raised("timed out", TimeoutError))[1])
    assert [r.row_id for r in of(info, "retry")] == [0, 1, 2, 100, 101]  # type: ignore[attr-defined]
    assert of(info, "lines_suppressed") == []
    observer.stopped()  # the runtime stops: what was held back is reported
    (summary,) = of(info, "lines_suppressed")
    assert summary.levelno == logging.WARNING
    assert "7 similar retry lines of queue q suppressed" in summary.getMessage()
    fields = {k: getattr(summary, k) for k in ("queue", "suppressed", "suppressed_event", "cause")}
    assert fields == {
        "queue": "q",
        "suppressed": 7,
        "suppressed_event": "retry",
        "cause": "ValueError: order # not found",
    }


def test_a_closing_window_reports_what_it_held_back_and_the_next_line_passes(
    info: pytest.LogCaptureFixture,
) -> None:
    observer = LogObserver(burst=1, window=0.2)

    def fail(row: int) -> None:
        msg = failing(row=row)
        tell(observer, msg, decide(RETRY, msg, raised("boom"))[1])

    async def scenario() -> None:
        for row in range(3):
            fail(row)
        summary = await eventually(lambda: of(info, "lines_suppressed"), "the window's report")
        assert [s.suppressed for s in summary] == [2]  # type: ignore[attr-defined]
        fail(3)  # a window of its own

    asyncio.run(scenario())
    assert [r.row_id for r in of(info, "retry")] == [0, 3]  # type: ignore[attr-defined]


def test_at_debug_every_retry_is_logged_with_its_frames(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="outbox_farm")
    observer = LogObserver(burst=1)
    for row in range(4):
        msg = failing(row=row)
        tell(observer, msg, decide(RETRY, msg, raised("boom"))[1])
    observer.stopped()
    retries = of(caplog, "retry")
    assert len(retries) == 4
    assert all(r.getMessage().count(FRAMES_HEADER) == 1 for r in retries)
    assert of(caplog, "lines_suppressed") == []


def test_the_limit_keeps_a_bounded_number_of_windows() -> None:
    """With room for 2 kinds, a third is not limited while both windows last (its lines are
    all let through), and is once one of them ended."""
    now = [0.0]
    reports: list[tuple[Kind, int, float]] = []
    limit = RepeatLimit(
        1, 10.0, lambda *report: reports.append(report), keys=2, clock=lambda: now[0]
    )
    assert limit.admit("q", "retry", "first")
    assert limit.admit("q", "retry", "second")
    assert not limit.admit("q", "retry", "first")  # held back: the limit holds
    assert all(limit.admit("q", "retry", "third") for _ in range(5))  # no room: not limited
    now[0] = 10.0  # both windows ended: dropped, the first's count reported
    assert limit.admit("q", "retry", "third")
    assert not limit.admit("q", "retry", "third")
    assert reports == [(("q", "retry", "first"), 1, 10.0)]


def test_a_kind_whose_window_ended_reports_when_its_next_line_passes() -> None:
    """Off an event loop there is no timer: the next line of the kind brings the report."""
    now = [0.0]
    reports: list[tuple[Kind, int, float]] = []
    limit = RepeatLimit(2, 5.0, lambda *report: reports.append(report), clock=lambda: now[0])
    assert [limit.admit("q", "retry", "row 1 failed") for _ in range(4)] == [
        True,
        True,
        False,
        False,
    ]
    assert reports == []
    now[0] = 7.5
    assert limit.admit("q", "retry", "row 2 failed")
    assert reports == [(("q", "retry", "row # failed"), 2, 7.5)]


def test_both_formats_keep_a_retry_on_one_line_with_its_fields(
    info: pytest.LogCaptureFixture,
) -> None:
    observer = LogObserver(burst=1)
    for row in (1, 2):
        msg = failing(row=row)
        tell(observer, msg, decide(RETRY, msg, raised("bad\nsku"))[1])
    observer.stopped()
    retry, summary = of(info, "retry")[0], of(info, "lines_suppressed")[0]
    text = TextFormatter().format(retry)
    assert "\n" not in text
    assert text.endswith("[event=retry]")
    entry = orjson.loads(JsonFormatter().format(retry))
    assert {k: entry[k] for k in ("event", "queue", "row_id", "attempt", "delay")} == {
        "event": "retry",
        "queue": "q",
        "row_id": 1,
        "attempt": 1,
        "delay": 1.0,
    }
    assert (entry["error_type"], entry["error"]) == ("ValueError", "ValueError: bad…[truncated]")
    counted = orjson.loads(JsonFormatter().format(summary))
    assert (counted["event"], counted["suppressed"], counted["cause"]) == (
        "lines_suppressed",
        1,
        "ValueError: bad…[truncated]",
    )


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no")


class Custom(Exception):
    pass


@pytest.mark.parametrize(
    ("exc", "line"),
    [
        (ValueError("x" * 5_000_000), None),
        (KeyError("sku"), "KeyError: 'sku'"),
        (ValueError(""), "ValueError"),
        (ValueError("one\r\ntwo"), "ValueError: one…[truncated]"),
        (_Unprintable(), f"{__name__}._Unprintable: <str() failed with RuntimeError>"),
        (Custom("why"), f"{__name__}.Custom: why"),
    ],
)
def test_an_exception_line_is_one_bounded_line(exc: BaseException, line: str | None) -> None:
    text = exception_line(exc)
    assert "\n" not in text
    assert len(text) <= LINE_MAX
    if line is None:
        assert text.startswith("ValueError: xxx")
        assert text.endswith("…[truncated]")
    else:
        assert text == line
