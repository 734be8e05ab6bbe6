"""The log of a queue whose handler fails on every row (issue 45, item 5): 30 bad rows retried
twice each gave a traceback of several lines per retry. Now a retry is one line, at most
`logs.BURST` of one cause pass, the rest are counted in one line, and each row's terminal failure
carries its frames once."""

from __future__ import annotations

import asyncio
import logging

import psycopg
import pytest

from outbox_farm import ConstantBackoff, Farm, Message
from outbox_farm.cli.log_setup import TextFormatter
from outbox_farm.observe import logs
from outbox_farm.outcome import FRAMES_HEADER
from tests.integration.delivery_kit import DLQ, POLL, database, qname, records
from tests.steps import eventually, publish

ROWS, ATTEMPTS = 30, 3


def test_a_failing_queue_logs_a_line_per_kept_retry_and_counts_the_rest(
    dsn: str, conn: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    q = qname("bad")
    farm = Farm(dlq_table=DLQ)
    ids = publish(conn, [{"sku": n} for n in range(ROWS)], queue=q)

    @farm.handler(q, retry=ConstantBackoff(0.05, max_attempts=ATTEMPTS))
    async def handle(msg: Message) -> None:
        raise LookupError(f"sku {msg.json()['sku']} unknown")

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):

            async def dead() -> bool:
                return len(await db.dlq_rows(q)) == ROWS

            await eventually(dead, "every row in the DLQ")

    with caplog.at_level(logging.INFO, logger="outbox_farm"):
        asyncio.run(scenario())

    retries = records(caplog, "retry", queue=q)
    assert len(retries) == logs.BURST
    (summary,) = records(caplog, "lines_suppressed", queue=q)  # reported as the runtime stops
    assert len(retries) + summary.suppressed == ROWS * (ATTEMPTS - 1)  # type: ignore[attr-defined]
    assert summary.cause == "LookupError: sku # unknown"  # type: ignore[attr-defined]
    text = TextFormatter()
    assert all("\n" not in text.format(r) for r in [*retries, summary])
    terminal = records(caplog, "terminal", queue=q)
    assert sorted(r.row_id for r in terminal) == ids  # type: ignore[attr-defined]
    assert all(r.getMessage().count(FRAMES_HEADER) == 1 for r in terminal)
