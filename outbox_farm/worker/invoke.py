"""How a handler is called: the one call path the executor and the test kit's recorder share,
so that a test's verdicts are production's.

A handler runs behind its middleware chain (the farm's first, then the queue's own; see
`middleware`): an async handler is awaited on the event loop, a plain function runs in a thread
of its own. A run past its timeout is named `HandlerTimeout` by both callers, each of which
enforces the timeout its own way (the executor with one watchdog per queue, the recorder with
`asyncio.timeout`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from .. import decision
from ..handler import HandlerSpec
from ..message import Message
from ..middleware import chain
from ..outcome import Outcome

log = logging.getLogger("outbox_farm.executor")

Call = Callable[[Any], Awaitable[Any]]


class HandlerTimeout(TimeoutError):
    """The handler (a batch handler: the whole call) ran past its timeout and was abandoned."""


async def _in_thread(func: Callable[[Any], Any], name: str, arg: Any) -> Any:
    """Run a sync handler in a thread of its own.

    Not a shared pool: a hung handler that timed out keeps its thread, and in a pool it would
    hold a slot that later messages then wait for (and time out in, without ever running). The
    executor tasks already bound how many run at once; an abandoned thread holds no slot.

    The handler's exception travels as a value and is raised here: an exception set on the
    future would be thrown into the awaiting coroutine, and a thrown GeneratorExit closes it
    instead of reaching its `except`.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[tuple[BaseException | None, Any]] = loop.create_future()

    def settle(error: BaseException | None, result: object) -> None:
        if not future.done():
            future.set_result((error, result))

    def target() -> None:
        try:
            result, error = func(arg), None
        except BaseException as caught:
            result, error = None, caught
        with contextlib.suppress(RuntimeError):  # the loop closed: this run was abandoned
            loop.call_soon_threadsafe(settle, error, result)

    threading.Thread(target=target, daemon=True, name=name).start()
    error, result = await future
    if error is not None:
        raise error
    return result


def call_path(spec: HandlerSpec, handler: Call | None = None) -> Call:
    """`spec`'s handler (or `handler`, which stands in for it: the executor's transactional
    wrapper) behind the middleware chain, as one awaitable call of the handler's argument."""
    if handler is None:
        if spec.is_async:
            handler = spec.func
        else:
            handler = partial(_in_thread, spec.func, f"outbox-farm-{spec.queue}")
    return chain(spec.middleware, handler)


def timed_out(spec: HandlerSpec) -> HandlerTimeout:
    return HandlerTimeout(
        f"handler of queue {spec.queue!r} exceeded its timeout of {spec.effective_timeout:g}s"
    )


async def on_failure(
    spec: HandlerSpec, msg: Message, exc: BaseException | None, outcome: Outcome
) -> None:
    """The queue's on_failure hook for a run that failed, called after the outcome was handed
    over so that it cannot change it. Whatever the hook raises is logged (`hook_failed`) and
    changes nothing: in a farm and in a test alike."""
    hook, error = spec.on_failure, decision.failure(msg, exc)
    if hook is None or error is None:
        return
    try:
        result = hook(msg, error, outcome)
        if inspect.isawaitable(result):
            await result
    except asyncio.CancelledError:
        raise
    except BaseException:
        log.exception(
            "on_failure hook %r raised for row %s of queue %s; the outcome (%s) stands",
            hook,
            msg.id,
            msg.queue,
            outcome.kind.value,
            extra={"event": "hook_failed", "row_id": msg.id, "queue": msg.queue},
        )
