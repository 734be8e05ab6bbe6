"""The middleware chain a handler is called through.

A middleware is `async def mw(arg, call_next) -> Any`: `arg` is what the handler receives (a
`Message`, or the list of them for a batch handler), `await call_next(arg)` runs the rest of
the chain and returns the handler's result. A middleware may short-circuit (return without
calling on), observe or replace the exception, or transform the result; the runtime ignores the
final result. Whatever escapes the chain is the run's exception, decided by the queue's policy
like a handler's own, and the chain as a whole is under the handler's timeout.

`Farm(middleware=[...])` wraps every queue's handler, outside the handler's own
(`farm.handler(..., middleware=[...])`); each list is outermost first. Tracing wraps the whole
chain; per-key ordering is the claim's (SQL), and a relay is a batch handler, not middleware.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from .errors import ConfigurationError

CallNext = Callable[[Any], Awaitable[Any]]
Middleware = Callable[[Any, CallNext], Awaitable[Any]]


def check(middleware: Sequence[Middleware], owner: str) -> tuple[Middleware, ...]:
    """The middleware as a tuple, refused at registration unless each one is callable."""
    if isinstance(middleware, str | bytes) or not isinstance(middleware, Sequence):
        raise ConfigurationError(f"{owner} middleware must be a list, got {middleware!r}")
    for each in middleware:
        if not callable(each):
            raise ConfigurationError(f"{owner} middleware must be callables, got {each!r}")
    return tuple(middleware)


def chain(middleware: Sequence[Middleware], handler: CallNext) -> CallNext:
    """`handler` called through `middleware`, the first one outermost.

    With no middleware this is `handler` itself: a plain queue pays nothing for the feature.
    Each link is a plain function returning the middleware's awaitable, so a message costs one
    coroutine per middleware and no more.
    """
    call = handler
    for each in reversed(middleware):
        call = _link(each, call)
    return call


def _link(middleware: Middleware, call_next: CallNext) -> CallNext:
    def call(arg: Any) -> Awaitable[Any]:
        return middleware(arg, call_next)

    return call
