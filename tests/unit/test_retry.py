"""The built-in retry strategies: how they are called, and the delays they compute."""

from __future__ import annotations

import inspect
import math
from typing import Any

import pytest

from outbox_farm.errors import ConfigurationError
from outbox_farm.retry import (
    ConstantBackoff,
    ExponentialBackoff,
    LinearBackoff,
    NoRetry,
    RetryStrategy,
)

EXC = RuntimeError("boom")
LIMITS = {"max_attempts", "max_total_delay", "jitter"}


def delays(strategy: RetryStrategy, attempts: int, elapsed: float = 0.0) -> list[float | None]:
    return [strategy.next_delay(n, EXC, elapsed) for n in range(1, attempts + 1)]


# --- signatures: the first delay is the one positional argument -----------------------------


@pytest.mark.parametrize(
    ("cls", "first"),
    [(ConstantBackoff, "delay"), (LinearBackoff, "first"), (ExponentialBackoff, "first")],
)
def test_only_the_first_delay_is_positional(cls: type, first: str) -> None:
    params = list(inspect.signature(cls).parameters.values())
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == [first]
    keyword_only = {p.name for p in params if p.kind is p.KEYWORD_ONLY}
    assert keyword_only >= LIMITS


def test_constant_backoff_of_half_a_second() -> None:
    strategy = ConstantBackoff(0.5)
    assert strategy.delay == 0.5
    assert strategy.max_attempts is None
    assert delays(strategy, 3) == [0.5, 0.5, 0.5]


def test_first_positional_argument_of_the_others() -> None:
    assert LinearBackoff(2.0).first == 2.0
    assert ExponentialBackoff(0.1).first == 0.1


@pytest.mark.parametrize(
    "make",
    [
        lambda: ConstantBackoff(0.5, 3),
        lambda: LinearBackoff(1.0, 2.0),
        lambda: ExponentialBackoff(1.0, 2.0, 300.0),
    ],
    ids=["constant", "linear", "exponential"],
)
def test_limits_cannot_be_passed_by_position(make: Any) -> None:
    with pytest.raises(TypeError, match="positional argument"):
        make()


@pytest.mark.parametrize("cls", [ConstantBackoff, LinearBackoff, ExponentialBackoff])
def test_every_strategy_takes_the_limits_by_keyword(cls: Any) -> None:
    strategy = cls(0.25, max_attempts=3, max_total_delay=60.0, jitter=0.0)
    assert delays(strategy, 3)[2] is None
    assert isinstance(strategy, RetryStrategy)


# --- maths ----------------------------------------------------------------------------------


def test_no_retry_is_always_terminal() -> None:
    assert delays(NoRetry(), 3) == [None, None, None]
    assert isinstance(NoRetry(), RetryStrategy)


def test_linear_grows_by_step_up_to_the_cap() -> None:
    assert delays(LinearBackoff(1.0, step=2.0, cap=6.0), 5) == [1.0, 3.0, 5.0, 6.0, 6.0]
    assert delays(LinearBackoff(4.0, step=0.0), 3) == [4.0, 4.0, 4.0]
    assert delays(LinearBackoff(10.0, cap=5.0), 2) == [5.0, 5.0]


def test_exponential_doubles_up_to_the_cap() -> None:
    strategy = ExponentialBackoff(1.0, factor=2.0, cap=10.0, jitter=0.0)
    assert delays(strategy, 6) == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_exponential_edge_cases() -> None:
    assert delays(ExponentialBackoff(3.0, factor=1.0, jitter=0.0), 3) == [3.0, 3.0, 3.0]
    assert delays(ExponentialBackoff(0.0, jitter=0.0), 3) == [0.0, 0.0, 0.0]
    assert delays(ExponentialBackoff(5.0, cap=0.0, jitter=0.0), 2) == [0.0, 0.0]
    assert delays(ExponentialBackoff(500.0, cap=300.0, jitter=0.0), 1) == [300.0]


def test_exponential_reaches_the_cap_at_huge_attempt_numbers() -> None:
    strategy = ExponentialBackoff(1.0, factor=10.0, cap=300.0, jitter=0.0)
    assert strategy.next_delay(10**6, EXC, 0.0) == 300.0


def test_max_attempts_counts_the_runs_so_far() -> None:
    assert delays(ConstantBackoff(1.0, max_attempts=3), 4) == [1.0, 1.0, None, None]
    assert delays(ConstantBackoff(1.0, max_attempts=1), 1) == [None]


def test_max_total_delay_stops_when_the_next_wait_would_pass_it() -> None:
    strategy = LinearBackoff(1.0, step=1.0, max_total_delay=10.0)
    assert strategy.next_delay(1, EXC, elapsed=8.0) == 1.0
    assert strategy.next_delay(3, EXC, elapsed=7.0) == 3.0
    assert strategy.next_delay(3, EXC, elapsed=7.5) is None


def test_jitter_stays_within_its_fraction() -> None:
    strategy = ExponentialBackoff(10.0, factor=1.0, jitter=0.2)
    seen = [strategy.next_delay(1, EXC, 0.0) for _ in range(500)]
    assert all(d is not None and 8.0 <= d <= 12.0 for d in seen)
    assert len(set(seen)) > 1
    assert ExponentialBackoff(1.0).jitter == 0.2
    assert ConstantBackoff(1.0).jitter == 0.0


@pytest.mark.parametrize(
    "strategy",
    [
        ConstantBackoff(10.0, jitter=0.5),
        LinearBackoff(10.0, step=0.0, jitter=0.5),
        ExponentialBackoff(10.0, factor=1.0, jitter=0.5),
    ],
    ids=["constant", "linear", "exponential"],
)
def test_every_strategy_jitters_within_its_fraction_of_the_delay(strategy: RetryStrategy) -> None:
    seen = [strategy.next_delay(1, EXC, 0.0) for _ in range(500)]
    assert all(d is not None and 5.0 <= d <= 15.0 for d in seen)
    assert min(d for d in seen if d is not None) < 7.5 < max(d for d in seen if d is not None)


def test_jitter_is_applied_after_the_cap() -> None:
    strategy = ExponentialBackoff(1.0, factor=2.0, cap=10.0, jitter=0.2)
    seen = [strategy.next_delay(20, EXC, 0.0) for _ in range(500)]
    assert all(d is not None and 8.0 <= d <= 12.0 for d in seen)
    assert any(d is not None and d > 10.0 for d in seen)


def test_full_jitter_never_goes_below_zero() -> None:
    strategy = ConstantBackoff(1.0, jitter=1.0)
    seen = [strategy.next_delay(1, EXC, 0.0) for _ in range(500)]
    assert all(d is not None and 0.0 <= d <= 2.0 for d in seen)


@pytest.mark.parametrize(
    "strategy",
    [
        ConstantBackoff(1.0, max_attempts=2),
        LinearBackoff(1.0, max_attempts=2),
        ExponentialBackoff(1.0, jitter=0.0, max_attempts=2),
    ],
    ids=["constant", "linear", "exponential"],
)
def test_every_strategy_stops_at_max_attempts(strategy: RetryStrategy) -> None:
    assert delays(strategy, 4) == [1.0, None, None, None]


def test_a_wait_that_ends_exactly_at_max_total_delay_is_allowed() -> None:
    strategy = ConstantBackoff(2.0, max_total_delay=10.0)
    assert strategy.next_delay(1, EXC, elapsed=8.0) == 2.0
    assert strategy.next_delay(1, EXC, elapsed=8.01) is None
    assert ExponentialBackoff(1.0, jitter=0.0, max_total_delay=0.0).next_delay(1, EXC, 0.0) is None


@pytest.mark.parametrize(("draw", "expected"), [(0.5, None), (-0.5, 5.0)])
def test_max_total_delay_judges_the_jittered_wait(
    monkeypatch: pytest.MonkeyPatch, draw: float, expected: float | None
) -> None:
    """10 s +/- 50 %: 15 s would pass the 14 s budget, 5 s would not."""
    monkeypatch.setattr("outbox_farm.retry.random.uniform", lambda low, high: draw)
    strategy = ConstantBackoff(10.0, jitter=0.5, max_total_delay=14.0)
    assert strategy.next_delay(1, EXC, elapsed=0.0) == expected


def test_the_first_limit_reached_ends_the_retries() -> None:
    strategy = ExponentialBackoff(1.0, jitter=0.0, max_attempts=5, max_total_delay=6.0)
    elapsed, seen = 0.0, []
    for attempt in range(1, 6):
        delay = strategy.next_delay(attempt, EXC, elapsed)
        seen.append(delay)
        if delay is None:
            break
        elapsed += delay
    assert seen == [1.0, 2.0, None]  # 1 + 2 + 4 would pass 6 s before the 5th attempt
    assert delays(ExponentialBackoff(1.0, jitter=0.0, max_attempts=2, max_total_delay=1e9), 3) == [
        1.0,
        None,
        None,
    ]


# --- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf, "0.5", True])
@pytest.mark.parametrize(
    ("cls", "name"),
    [(ConstantBackoff, "delay"), (LinearBackoff, "first"), (ExponentialBackoff, "first")],
)
def test_bad_first_delay_is_refused_naming_it(cls: Any, name: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match=f"^{name} must be"):
        cls(value)


@pytest.mark.parametrize("value", [0, 0.5, -1, True, "3"])
def test_max_attempts_must_be_a_whole_number(value: Any) -> None:
    with pytest.raises(ConfigurationError, match="max_attempts must be a whole number >= 1"):
        ConstantBackoff(1.0, max_attempts=value)


@pytest.mark.parametrize("value", [-0.1, 1.5, "0.1"])
def test_jitter_must_be_a_fraction(value: Any) -> None:
    with pytest.raises(ConfigurationError, match="jitter must be a fraction"):
        LinearBackoff(1.0, jitter=value)


def test_other_parameters_are_checked() -> None:
    with pytest.raises(ConfigurationError, match="max_total_delay must be"):
        ConstantBackoff(1.0, max_total_delay=-1)
    with pytest.raises(ConfigurationError, match="step must be"):
        LinearBackoff(1.0, step=math.inf)
    with pytest.raises(ConfigurationError, match="cap must be"):
        LinearBackoff(1.0, cap=-1)
    with pytest.raises(ConfigurationError, match="cap must be"):
        ExponentialBackoff(1.0, cap=math.nan)
    with pytest.raises(ConfigurationError, match="factor must be a finite number >= 1"):
        ExponentialBackoff(1.0, factor=0.5)
