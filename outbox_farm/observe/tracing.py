"""OpenTelemetry tracing (`pip install 'outbox-farm[tracing]'`, on with `Farm(tracing=True)`).

- `publish()` puts the caller's current trace context in the row's headers (`traceparent`,
  and `tracestate` when there is one), so the work a row causes can be joined to the request
  that committed it, however long the row waits.
- Each handler run, and each row of a relay batch, gets a span of its own (kind CONSUMER)
  linked to that context: linked, not a child, since a retry an hour later is not part of the
  request's trace. Its attributes follow the outbox conventions: `outbox.queue`,
  `outbox.row_id`, `outbox.retry_count` (attempts before this one), `outbox.deliveries`, and,
  once decided, `outbox.outcome` = published | retry | dlq | failed | released | lease_lost.
- While a handler runs its span is current, so the handler's own spans are its children and
  its log lines carry `trace_id` and `span_id` (see `current_ids`).

Without opentelemetry-api installed none of this is imported or called: the producer and the
log formatters check one module constant, and `Farm(tracing=True)` says what to install.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ..errors import ConfigurationError
from ..message import Message
from ..outcome import Kind, Outcome
from .base import Observer

try:
    from opentelemetry import propagate, trace
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode
except ImportError:  # the extra is not installed: tracing stays off, at no cost
    trace = None  # type: ignore[assignment]

INSTALLED = trace is not None
TRACE_HEADERS = ("traceparent", "tracestate")


def inject(headers: MutableMapping[str, Any]) -> None:
    """Add the current trace context to a row's headers (nothing when no span is active)."""
    if INSTALLED and trace.get_current_span().get_span_context().is_valid:
        propagate.inject(headers)


def current_ids() -> tuple[str, str] | None:
    """The current span's trace and span ids as hex, for log lines; None without one."""
    if not INSTALLED:
        return None
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


def _outcome(outcome: Outcome, dlq: bool) -> str:
    if outcome.kind is Kind.ACK:
        return "published"
    if outcome.kind is Kind.RETRY:
        return "retry"
    if outcome.kind is Kind.TERMINAL:
        return "dlq" if dlq else "failed"
    return "released"


class Tracing(Observer):
    """The farm's tracing: a middleware (outermost) that opens the spans, and an observer that
    closes each with its row's outcome."""

    def __init__(self, dlq: bool) -> None:
        if not INSTALLED:
            raise ConfigurationError(
                "tracing=True needs OpenTelemetry: pip install 'outbox-farm[tracing]' "
                "(opentelemetry-api, plus an SDK and exporter of your choice)"
            )
        self.dlq = dlq
        self.tracer = trace.get_tracer("outbox_farm")
        self._open: dict[tuple[str, int], Any] = {}

    def _start(self, msg: Message) -> Any:
        parent = propagate.extract({k: msg.headers[k] for k in TRACE_HEADERS if k in msg.headers})
        linked = trace.get_current_span(parent).get_span_context()
        span = self.tracer.start_span(
            f"outbox {msg.queue} process",
            kind=SpanKind.CONSUMER,
            links=[Link(linked)] if linked.is_valid else None,
            attributes={
                "messaging.system": "outbox_farm",
                "outbox.queue": msg.queue,
                "outbox.row_id": msg.id,
                "outbox.retry_count": msg.attempts_count,
                "outbox.deliveries": msg.deliveries_count,
            },
        )
        self._open[(msg.queue, msg.id)] = span
        return span

    async def __call__(self, arg: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
        if isinstance(arg, list):  # a batch (a relay's): a span per row, the call under none
            spans = [self._start(msg) for msg in arg]
            try:
                return await call_next(arg)
            except BaseException as exc:
                for span in spans:
                    span.record_exception(exc)
                raise
        span = self._start(arg)
        with trace.use_span(span, end_on_exit=False, record_exception=True):
            return await call_next(arg)

    def decided(self, msg: Message, outcome: Outcome) -> None:
        span = self._open.pop((msg.queue, msg.id), None)
        if span is None:
            return
        span.set_attribute("outbox.outcome", _outcome(outcome, self.dlq))
        if outcome.kind is Kind.TERMINAL:
            span.set_status(Status(StatusCode.ERROR, outcome.last_exception or str(outcome.reason)))
        if msg.error is not None:
            span.record_exception(msg.error)
        span.end()

    def lease_lost(self, phase: str, queue: str, row_id: int, deliveries: int | None) -> None:
        span = self._open.pop((queue, row_id), None)
        if span is not None:
            span.set_attribute("outbox.outcome", "lease_lost")
            span.end()
