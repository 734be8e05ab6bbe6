"""OpenTelemetry tracing against a real Postgres: `publish()` carries the caller's trace
context in the row, each handler run and each relayed row gets a span linked to it, with the
outcome; a handler's log lines carry the ids of its span."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import orjson
import psycopg
import pytest

from outbox_farm import ConfigurationError, ConstantBackoff, DeadLetter, Farm, Message
from outbox_farm.cli.log_setup import JsonFormatter
from outbox_farm.observe import tracing
from outbox_farm.relay import CONFIRMED, Delivery, Envelope
from outbox_farm.testing import drain

trace = pytest.importorskip("opentelemetry.trace")
sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
export = pytest.importorskip("opentelemetry.sdk.trace.export")
in_memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")

_EXPORTER = in_memory.InMemorySpanExporter()


@pytest.fixture
def spans() -> Iterator[Any]:
    """The spans finished during the test (the process's provider is set once)."""
    if not isinstance(trace.get_tracer_provider(), sdk_trace.TracerProvider):
        provider = sdk_trace.TracerProvider()
        provider.add_span_processor(export.SimpleSpanProcessor(_EXPORTER))
        trace.set_tracer_provider(provider)
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


def handled(exporter: Any) -> list[Any]:
    return [s for s in exporter.get_finished_spans() if s.name.startswith("outbox ")]


def test_a_handler_run_is_a_span_linked_to_the_publishing_request(dsn: str, spans: Any) -> None:
    farm = Farm(tracing=True)
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(JsonFormatter().format(record))

    log = logging.getLogger("test_tracing.handler")
    log.addHandler(keep := Keep())
    log.setLevel(logging.INFO)

    @farm.handler("mail", retry=ConstantBackoff(1, max_attempts=2))
    async def send(msg: Message) -> None:
        log.info("sending")
        if msg.json()["fail"]:
            raise RuntimeError("smtp down")

    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("POST /signup") as request, psycopg.connect(dsn) as conn:
        farm.publish(conn, {"fail": False}, queue="mail")
        farm.publish_batch(conn, [{"fail": True}], queue="mail")
    try:
        drain(farm, dsn, within=5)
    finally:
        log.removeHandler(keep)

    with psycopg.connect(dsn) as conn:
        headers = [h for (h,) in conn.execute("SELECT headers FROM outbox_dlq").fetchall()]
    trace_id = f"{request.get_span_context().trace_id:032x}"
    assert headers[0]["traceparent"].split("-")[1] == trace_id

    runs = sorted(handled(spans), key=lambda s: (s.attributes["outbox.row_id"], s.start_time))
    outcomes = [(s.attributes["outbox.row_id"], s.attributes["outbox.outcome"]) for s in runs]
    assert outcomes == [(1, "published"), (2, "retry"), (2, "dlq")]
    for span in runs:
        assert span.kind is trace.SpanKind.CONSUMER
        assert [link.context.trace_id for link in span.links] == [
            request.get_span_context().trace_id
        ]
        assert span.context.trace_id != request.get_span_context().trace_id  # linked, not child
    assert [s.attributes["outbox.retry_count"] for s in runs] == [0, 0, 1]
    assert runs[2].status.status_code is trace.StatusCode.ERROR
    assert any(e.name == "exception" for e in runs[1].events)

    logged = [orjson.loads(line) for line in lines]
    assert len(logged) == 3
    for entry, span in zip(logged, runs, strict=True):
        assert entry["trace_id"] == f"{span.context.trace_id:032x}"
        assert entry["span_id"] == f"{span.context.span_id:016x}"


class Confirming:
    label = "confirming"

    async def connect(self) -> None:
        pass

    async def publish(self, batch: Sequence[Envelope]) -> list[Delivery]:
        self.traceparents = [e.headers.get("traceparent") for e in batch]
        return [CONFIRMED] * len(batch)

    async def close(self) -> None:
        pass


def test_each_relayed_row_gets_its_span_and_the_broker_its_traceparent(
    dsn: str, spans: Any
) -> None:
    farm = Farm(tracing=True)
    target = Confirming()
    farm.relay("events", to=target)
    with trace.get_tracer("test").start_as_current_span("job"), psycopg.connect(dsn) as conn:
        farm.publish_batch(conn, [b"a", b"b", b"c"], queue="events")
    assert len(drain(farm, dsn).acked) == 3
    runs = handled(spans)
    assert len(runs) == 3
    assert {s.attributes["outbox.outcome"] for s in runs} == {"published"}
    assert all(t and t.startswith("00-") for t in target.traceparents)


def test_without_tracing_nothing_is_added(dsn: str, spans: Any) -> None:
    farm = Farm()

    @farm.handler("plain")
    async def plain(msg: Message) -> None:
        if msg.id < 0:
            raise DeadLetter("never")

    with trace.get_tracer("test").start_as_current_span("req"), psycopg.connect(dsn) as conn:
        farm.publish(conn, {}, queue="plain")
        [(headers,)] = conn.execute("SELECT headers FROM outbox").fetchall()
    assert "traceparent" not in headers
    drain(farm, dsn)
    assert handled(spans) == []


def test_tracing_without_opentelemetry_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tracing, "INSTALLED", False)
    with pytest.raises(ConfigurationError, match=r"pip install 'outbox-farm\[tracing\]'"):
        Farm(tracing=True)
    assert tracing.current_ids() is None
