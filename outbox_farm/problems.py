"""Permanent database errors the runtime keeps running into, for logs and health checks.

A missing privilege, table or column does not go away by retrying, yet the runtime keeps
retrying (an operator may fix it any moment, and nothing is lost meanwhile). So that such a
state is neither silent nor a log flood, each one is logged at ERROR at most once a minute per
operation and kind, and the latest is exposed as `Runtime.problem` until the operation that
failed succeeds again. Only `PermanentError`s are problems: a lost connection or a refused
statement passes by itself, and is the caller's to log.
"""

from __future__ import annotations

import logging
import time

from .errors import DatabaseError, PermanentError

LOG_EVERY = 60.0


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


class Problems:
    """The open problems of one runtime, by the operation that ran into them."""

    def __init__(self) -> None:
        self._open: dict[str, str] = {}
        self._logged: dict[tuple[str, str | None], float] = {}

    @property
    def current(self) -> str | None:
        """The most recent open problem, as one line; None while there is none."""
        if not self._open:
            return None
        operation, reason = next(reversed(self._open.items()))
        return f"{operation}: {reason}"

    def report(
        self,
        operation: str,
        exc: DatabaseError,
        logger: logging.Logger,
        extra: dict[str, object] | None = None,
    ) -> bool:
        """Record `exc` if it is permanent, and log it unless that was done in the last minute
        (`extra`: the caller's structured log fields). False for any other error: the caller
        handles it as before."""
        if not isinstance(exc, PermanentError):
            return False
        reason = one_line(exc)
        self._open.pop(operation, None)
        self._open[operation] = reason
        sqlstate = exc.sqlstate
        key = (operation, sqlstate)
        now = time.monotonic()
        if now - self._logged.get(key, -LOG_EVERY) >= LOG_EVERY:
            self._logged[key] = now
            logger.error(
                "%s failed: %s. This does not pass by retrying: grant the privilege or run "
                "`outbox-farm migrate` / `outbox-farm check`. Retrying meanwhile; logged at "
                "most once a minute",
                operation,
                reason,
                extra={
                    "event": "permanent_error",
                    "operation": operation,
                    "sqlstate": sqlstate,
                    **(extra or {}),
                },
            )
        return True

    def solved(self, operation: str) -> None:
        """`operation` succeeded: whatever problem it had is over."""
        if self._open and self._open.pop(operation, None) is not None:
            self._logged = {k: v for k, v in self._logged.items() if k[0] != operation}
