"""The decision core, rule by rule: no database, no event loop, no clock."""

from __future__ import annotations

import math
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from logging import ERROR, WARNING
from typing import Any

import pytest

from outbox_farm import decision
from outbox_farm.decision import Event, NoDecision, Notes, Verdict
from outbox_farm.errors import DeadLetter, Retry
from outbox_farm.handler import AckPolicy, HandlerSpec
from outbox_farm.message import Decision, Message
from outbox_farm.outcome import Kind, Outcome, Reason
from outbox_farm.retry import ConstantBackoff, NoRetry

NOW = 1_700_000_000.0  # the run's start, epoch seconds on the database clock
RAN = 0.25  # how long it ran
TOKEN = uuid.uuid4()
BOOM = ValueError("boom")


class Strategy:
    """A retry strategy that returns `value` and records what it was asked."""

    def __init__(self, value: Any = 7.0) -> None:
        self.value = value
        self.calls: list[tuple[int, BaseException, float]] = []

    def next_delay(self, attempt: int, exc: BaseException, elapsed: float) -> Any:
        self.calls.append((attempt, exc, elapsed))
        return self.value


class Raises:
    def next_delay(self, attempt: int, exc: BaseException, elapsed: float) -> float | None:
        raise RuntimeError("strategy bug")


def spec(**options: Any) -> HandlerSpec:
    return HandlerSpec(queue="q", func=lambda msg: None, **options)


def message(
    *, deliveries: int = 1, attempts: int = 0, first: datetime | None = None, **decided: Any
) -> Message:
    at = datetime.fromtimestamp(NOW - 60, UTC)
    msg = Message(
        id=42,
        queue="q",
        body=b"x",
        headers={},
        deliveries_count=deliveries,
        attempts_count=attempts,
        created_at=at,
        next_attempt_at=at,
        first_attempt_at=first,
        timer_id=None,
        lease_token=TOKEN,
        claimed_at=at,
    )
    for name, value in decided.items():
        setattr(msg, name, value)
    return msg


def events(notes: Notes) -> list[tuple[Event, int]]:
    """Each note's event and level; and every note's text renders with its arguments."""
    for note in notes:
        assert note.text % note.args
    return [(note.event, note.level) for note in notes]


def decide(policy: HandlerSpec, msg: Message, exc: BaseException | None = None) -> Verdict:
    return decision.decide(policy, msg, exc, NOW, RAN)


def is_row(outcome: Outcome, kind: Kind) -> bool:
    return (outcome.kind, outcome.row_id, outcome.token, outcome.queue) == (kind, 42, TOKEN, "q")


def retried(outcome: Outcome, delay: float) -> bool:
    started = datetime.fromtimestamp(NOW, UTC)
    return is_row(outcome, Kind.RETRY) and (outcome.delay, outcome.ran, outcome.started_at) == (
        delay,
        True,
        started,
    )


TERMINAL = (Event.TERMINAL, ERROR)
RETRY = (Event.RETRY, WARNING)


# -- before the run: max_deliveries ----------------------------------------------------------


@pytest.mark.parametrize(("limit", "deliveries"), [(None, 1000), (3, 1), (3, 3)])
def test_a_row_within_max_deliveries_runs(limit: int | None, deliveries: int) -> None:
    assert decision.before_run(spec(max_deliveries=limit), message(deliveries=deliveries)) is None


def test_a_row_claimed_more_than_max_deliveries_is_terminal_unrun() -> None:
    verdict = decision.before_run(spec(max_deliveries=3), message(deliveries=4))
    assert verdict is not None
    outcome, notes = verdict
    assert is_row(outcome, Kind.TERMINAL)
    assert (outcome.reason, outcome.last_exception, outcome.deliveries_count) == (
        Reason.MAX_DELIVERIES,
        None,
        4,
    )
    assert events(notes) == [TERMINAL]
    assert notes[0].fields == {"reason": "max_deliveries"}


# -- the handler returned ----------------------------------------------------------------------


@pytest.mark.parametrize("ack", [AckPolicy.ACK_ON_SUCCESS, AckPolicy.REJECT_ON_ERROR])
def test_a_return_acks(ack: AckPolicy) -> None:
    outcome, notes = decide(spec(ack=ack), message())
    assert is_row(outcome, Kind.ACK)
    assert notes == ()


def test_a_manual_handler_that_returns_undecided_is_retried_as_a_no_decision() -> None:
    strategy = Strategy(3.0)
    outcome, notes = decide(spec(ack=AckPolicy.MANUAL, retry=strategy), message())
    assert retried(outcome, 3.0)
    assert events(notes) == [(Event.NO_DECISION, WARNING), RETRY]
    ((_, exc, _),) = strategy.calls
    assert isinstance(exc, NoDecision)
    assert notes[0].error is exc
    assert "without ack(), nack() or reject()" in str(exc)


def test_a_manual_handler_undecided_once_too_often_is_terminal() -> None:
    outcome, notes = decide(spec(ack=AckPolicy.MANUAL, retry=NoRetry()), message())
    assert is_row(outcome, Kind.TERMINAL)
    assert outcome.reason is Reason.RETRY_TERMINAL
    assert (outcome.last_exception or "").startswith("NoDecision(")
    assert events(notes) == [(Event.NO_DECISION, WARNING), TERMINAL]


# -- the handler raised -----------------------------------------------------------------------


def test_an_exception_is_retried_after_the_strategys_delay() -> None:
    strategy = Strategy(7.0)
    first = datetime.fromtimestamp(NOW - 100, UTC)
    outcome, notes = decide(spec(retry=strategy), message(attempts=2, first=first), BOOM)
    assert retried(outcome, 7.0)
    assert strategy.calls == [(3, BOOM, 100 + RAN)]  # runs so far; since the first attempt
    assert events(notes) == [RETRY]
    assert notes[0].error is BOOM


def test_a_first_attempt_has_run_only_its_own_duration() -> None:
    strategy = Strategy(1.0)
    decide(spec(retry=strategy), message(), BOOM)
    assert strategy.calls == [(1, BOOM, RAN)]


def test_a_strategy_that_gives_up_makes_the_failure_terminal() -> None:
    outcome, notes = decide(spec(retry=NoRetry()), message(), BOOM)
    assert is_row(outcome, Kind.TERMINAL)
    assert outcome.reason is Reason.RETRY_TERMINAL
    assert (outcome.last_exception or "").startswith(repr(BOOM))
    assert events(notes) == [TERMINAL]
    assert notes[0].error is BOOM


@pytest.mark.parametrize(
    "strategy",
    [Raises(), Strategy(math.nan), Strategy(math.inf), Strategy(-1.0), Strategy("soon")],
    ids=["raises", "nan", "inf", "negative", "not-a-number"],
)
def test_a_broken_strategy_makes_the_failure_terminal_and_says_so(strategy: Any) -> None:
    outcome, notes = decide(spec(retry=strategy), message(), BOOM)
    assert is_row(outcome, Kind.TERMINAL)
    assert outcome.reason is Reason.RETRY_TERMINAL
    assert (outcome.last_exception or "").startswith(repr(BOOM))
    assert events(notes) == [(Event.STRATEGY_FAILED, ERROR), TERMINAL]
    assert isinstance(notes[0].error, RuntimeError | ValueError)


@pytest.mark.parametrize("value", [3, Decimal("0.5"), 0.0])
def test_a_strategy_may_return_any_number_of_seconds(value: Any) -> None:
    outcome, _ = decide(spec(retry=Strategy(value)), message(), BOOM)
    assert retried(outcome, float(value))


@pytest.mark.parametrize("ack", [AckPolicy.ACK_ON_SUCCESS, AckPolicy.MANUAL])
def test_dead_letter_is_rejected_at_once_whatever_the_strategy(ack: AckPolicy) -> None:
    error = DeadLetter("poison")
    outcome, notes = decide(spec(ack=ack, retry=ConstantBackoff(1.0)), message(), error)
    assert is_row(outcome, Kind.TERMINAL)
    assert outcome.reason is Reason.REJECTED
    assert (outcome.last_exception or "").startswith(repr(error))
    assert events(notes) == [TERMINAL]


def test_reject_on_error_rejects_any_exception() -> None:
    policy = spec(ack=AckPolicy.REJECT_ON_ERROR, retry=ConstantBackoff(1.0))
    outcome, _ = decide(policy, message(), BOOM)
    assert (outcome.kind, outcome.reason) == (Kind.TERMINAL, Reason.REJECTED)


@pytest.mark.parametrize(("error", "delay"), [(Retry(delay=2.0), 2.0), (Retry(), 4.0)])
def test_reject_on_error_still_honours_retry(error: Retry, delay: float) -> None:
    policy = spec(ack=AckPolicy.REJECT_ON_ERROR, retry=Strategy(4.0))
    outcome, _ = decide(policy, message(), error)
    assert retried(outcome, delay)


@pytest.mark.parametrize(
    ("delay", "seconds"),
    [(5, 5.0), (0, 0.0), (timedelta(seconds=2), 2.0), (Decimal("0.5"), 0.5)],
)
def test_retry_with_a_delay_takes_that_delay_not_the_strategys(delay: Any, seconds: float) -> None:
    strategy = Strategy(99.0)
    error = Retry(delay=delay)
    outcome, notes = decide(spec(retry=strategy), message(), error)
    assert retried(outcome, seconds)
    assert strategy.calls == []
    assert events(notes) == [RETRY]


def test_retry_without_a_delay_takes_the_strategys() -> None:
    outcome, notes = decide(spec(retry=Strategy(4.0)), message(), Retry())
    assert retried(outcome, 4.0)
    assert events(notes) == [RETRY]


@pytest.mark.parametrize("delay", [-1.0, math.nan, math.inf, "soon", timedelta(seconds=-1)])
def test_retry_with_a_bad_delay_takes_the_strategys_and_says_so(delay: Any) -> None:
    outcome, notes = decide(spec(retry=Strategy(4.0)), message(), Retry(delay=delay))
    assert retried(outcome, 4.0)
    assert events(notes) == [(Event.BAD_RETRY_DELAY, WARNING), RETRY]
    assert notes[0].args[0] is delay


# -- the handler decided ----------------------------------------------------------------------


def test_a_recorded_ack_wins_over_an_exception() -> None:
    msg = message()
    msg.ack()
    outcome, notes = decide(spec(), msg, BOOM)
    assert is_row(outcome, Kind.ACK)
    assert notes == ()


@pytest.mark.parametrize(
    ("error", "exc", "text"),
    [(None, None, None), (None, BOOM, repr(BOOM)), (KeyError("k"), BOOM, repr(KeyError("k")))],
    ids=["plain", "with-the-handlers-exception", "with-its-own-error"],
)
def test_a_recorded_reject_is_terminal_with_its_error_else_the_handlers(
    error: BaseException | None, exc: BaseException | None, text: str | None
) -> None:
    msg = message()
    msg.reject(error)
    outcome, notes = decide(spec(retry=ConstantBackoff(1.0)), msg, exc)
    assert is_row(outcome, Kind.TERMINAL)
    assert outcome.reason is Reason.REJECTED
    assert (outcome.last_exception or "").split("\n")[0] == (text or "")
    assert events(notes) == [TERMINAL]


def test_a_recorded_nack_with_a_delay_retries_after_it_quietly() -> None:
    strategy = Strategy(99.0)
    msg = message()
    msg.nack(2.0)
    outcome, notes = decide(spec(retry=strategy), msg)
    assert retried(outcome, 2.0)
    assert notes == ()
    assert strategy.calls == []


def test_a_recorded_nack_without_a_delay_takes_the_strategys() -> None:
    strategy = Strategy(4.0)
    msg = message()
    msg.nack()
    outcome, notes = decide(spec(retry=strategy), msg)
    assert retried(outcome, 4.0)
    assert notes == ()
    assert isinstance(strategy.calls[0][1], NoDecision)


def test_a_nacks_error_is_what_the_strategy_and_the_log_see() -> None:
    strategy = Strategy(4.0)
    error = ConnectionError("broker gone")
    msg = message()
    msg.nack(error=error)
    outcome, notes = decide(spec(retry=strategy), msg, BOOM)
    assert retried(outcome, 4.0)
    assert strategy.calls[0][1] is error
    assert events(notes) == [RETRY]
    assert notes[0].error is error


def test_a_recorded_nack_the_strategy_gives_up_on_is_terminal() -> None:
    msg = message()
    msg.nack()
    outcome, notes = decide(spec(retry=NoRetry()), msg, BOOM)
    assert (outcome.kind, outcome.reason) == (Kind.TERMINAL, Reason.RETRY_TERMINAL)
    assert (outcome.last_exception or "").startswith(repr(BOOM))
    assert events(notes) == [TERMINAL]


def test_the_last_decision_wins_and_an_ack_forgets_an_error() -> None:
    msg = message()
    msg.reject(KeyError("k"))
    msg.ack()
    assert msg.error is None
    assert is_row(decide(spec(), msg)[0], Kind.ACK)


def test_only_an_exception_can_be_a_decisions_error() -> None:
    with pytest.raises(TypeError, match="error must be an exception"):
        message().nack(error="not an exception")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="error must be an exception"):
        message().reject("why")  # type: ignore[arg-type]


def test_failure_is_the_decisions_error_else_the_runs_exception() -> None:
    msg = message()
    assert decision.failure(msg, None) is None
    assert decision.failure(msg, BOOM) is BOOM
    msg.nack(error=KeyError("k"))
    assert isinstance(decision.failure(msg, BOOM), KeyError)


# -- rows that did not run, or whose run was cut short ------------------------------------------


def test_a_run_interrupted_by_a_stop_is_tried_again_at_once() -> None:
    outcome, notes = decision.interrupted(spec(retry=Strategy(99.0)), message(), NOW, RAN)
    assert retried(outcome, 0.0)
    assert notes == ()


def test_a_run_interrupted_by_a_stop_keeps_what_the_handler_decided() -> None:
    acked, rejected = message(), message()
    acked.ack()
    rejected.reject()
    assert is_row(decision.interrupted(spec(), acked, NOW, RAN)[0], Kind.ACK)
    outcome, notes = decision.interrupted(spec(), rejected, NOW, RAN)
    assert (outcome.kind, outcome.reason) == (Kind.TERMINAL, Reason.REJECTED)
    assert events(notes) == [TERMINAL]


def test_a_row_whose_lease_ran_short_is_handed_back_and_says_so() -> None:
    outcome, notes = decision.expired(spec(lease_ttl=10.0), message(deliveries=2))
    assert is_row(outcome, Kind.EXPIRE)
    assert events(notes) == [(Event.LEASE_LOST, WARNING)]
    assert notes[0].fields == {"phase": "start", "deliveries_count": 2}
    assert "lease_ttl=10s" in notes[0].text % notes[0].args


def test_a_row_unstarted_at_a_stop_is_released() -> None:
    assert is_row(decision.released(message()), Kind.RELEASE)


@pytest.mark.parametrize(
    ("policy", "decided", "completes"),
    [
        (AckPolicy.ACK_ON_SUCCESS, None, True),
        (AckPolicy.REJECT_ON_ERROR, None, True),
        (AckPolicy.MANUAL, None, False),
        (AckPolicy.MANUAL, Decision.ACK, True),
        (AckPolicy.ACK_ON_SUCCESS, Decision.NACK, False),
        (AckPolicy.ACK_ON_SUCCESS, Decision.REJECT, False),
    ],
)
def test_a_transactional_handler_completes_its_row_exactly_when_decide_would_ack(
    policy: AckPolicy, decided: Decision | None, completes: bool
) -> None:
    policy_spec, msg = spec(ack=policy), message(decision=decided)
    assert decision.completes(policy_spec, msg) is completes
    outcome, _ = decide(policy_spec, msg)
    assert (outcome.kind is Kind.ACK) is completes
