"""Retry strategies: how long to wait before the next attempt, or None to give up.

A strategy sees the attempt number (handler runs so far, including the one that just failed),
the exception, and the seconds since the first attempt (database clock). Returning None, or
raising, makes the failure terminal (`retry_terminal`); the executor never lets a strategy's
own bug crash the worker or silently drop the row.

The built-in strategies take their first delay as the one positional argument
(`ConstantBackoff(0.5)`, `ExponentialBackoff(1.0, cap=60)`); everything else, the limits above
all, is keyword-only, so a number can never land in `max_attempts` by position.
"""

from __future__ import annotations

import math
import random
from dataclasses import KW_ONLY, dataclass
from typing import Protocol, runtime_checkable

from .errors import ConfigurationError


@runtime_checkable
class RetryStrategy(Protocol):
    def next_delay(self, attempt: int, exc: BaseException, elapsed: float) -> float | None:
        """Seconds to wait before attempt `attempt + 1`, or None to stop retrying."""
        ...


def check_seconds(
    value: object, what: str, *, allow_none: bool = False, positive: bool = False
) -> None:
    """Refuse NaN, infinities, negatives (and zero when `positive`) at configuration time."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(f"{what} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ConfigurationError(f"{what} must be finite and {bound}, got {value!r}")


def _check_attempts(value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigurationError(f"max_attempts must be a whole number >= 1, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class _Bounded:
    """Limits shared by the built-in strategies: keyword-only in every one of them."""

    max_attempts: int | None = None
    max_total_delay: float | None = None
    jitter: float = 0.0

    def __post_init__(self) -> None:
        _check_attempts(self.max_attempts)
        check_seconds(self.max_total_delay, "max_total_delay", allow_none=True)
        if not (isinstance(self.jitter, int | float) and 0 <= self.jitter <= 1):
            raise ConfigurationError(f"jitter must be a fraction in [0, 1], got {self.jitter!r}")

    def base_delay(self, attempt: int) -> float:
        raise NotImplementedError

    def next_delay(self, attempt: int, exc: BaseException, elapsed: float) -> float | None:
        if self.max_attempts is not None and attempt >= self.max_attempts:
            return None
        delay = self.base_delay(attempt)
        if self.jitter:
            delay *= 1 + random.uniform(-self.jitter, self.jitter)
        if self.max_total_delay is not None and elapsed + delay > self.max_total_delay:
            return None
        return max(delay, 0.0)


@dataclass(frozen=True)
class NoRetry:
    """The first failure is terminal."""

    def next_delay(self, attempt: int, exc: BaseException, elapsed: float) -> float | None:
        return None


@dataclass(frozen=True)
class ConstantBackoff(_Bounded):
    """The same delay every time: `ConstantBackoff(0.5, max_attempts=5)`."""

    delay: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_seconds(self.delay, "delay")

    def base_delay(self, attempt: int) -> float:
        return self.delay


@dataclass(frozen=True)
class LinearBackoff(_Bounded):
    """first, first + step, first + 2*step, ... capped at `cap`: `LinearBackoff(1.0, step=2)`."""

    first: float = 1.0
    _: KW_ONLY
    step: float = 1.0
    cap: float = 300.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_seconds(self.first, "first")
        check_seconds(self.step, "step")
        check_seconds(self.cap, "cap")

    def base_delay(self, attempt: int) -> float:
        return min(self.cap, self.first + self.step * (attempt - 1))


@dataclass(frozen=True)
class ExponentialBackoff(_Bounded):
    """first * factor**(attempt-1), capped at `cap`, with +/- `jitter` (a fraction) applied
    after the cap: `ExponentialBackoff(1.0, factor=2, cap=300)`."""

    first: float = 1.0
    _: KW_ONLY
    factor: float = 2.0
    cap: float = 300.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        check_seconds(self.first, "first")
        check_seconds(self.cap, "cap")
        if not (
            isinstance(self.factor, int | float) and math.isfinite(self.factor) and self.factor >= 1
        ):
            raise ConfigurationError(f"factor must be a finite number >= 1, got {self.factor!r}")

    def base_delay(self, attempt: int) -> float:
        # Growth in log space: a large attempt number reaches the cap instead of overflowing.
        exponent = (attempt - 1) * math.log(self.factor) if self.factor > 1 else 0.0
        if self.first == 0 or exponent + math.log(self.first) >= math.log(self.cap or 1e-300):
            return min(self.cap, self.first) if self.first == 0 else self.cap
        return float(self.first * self.factor ** (attempt - 1))
