"""A stall is never silent (issue 25, item 3; invariant 13).

A queue whose claims keep failing, or whose oldest ready row ages while the worker is idle,
is reported by the runtime (`Runtime.problem`, which the worker hands to the arbiter's
/healthz), counted (`outbox_farm_claim_errors_total{queue,kind}`) and flagged
(`outbox_farm_queue_stalled{queue}`); once the queue flows again all of that clears. Another
queue of the same runtime keeps flowing throughout (the positive control).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY

from outbox_farm import Farm, Message
from outbox_farm.metrics import metrics
from outbox_farm.worker import fetcher
from tests.steps import eventually

metrics()  # the collectors exist before the first sample is read


def qname(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def stalled(queue: str) -> float | None:
    return REGISTRY.get_sample_value("outbox_farm_queue_stalled", {"queue": queue})


def claim_errors(queue: str, kind: str) -> float:
    labels = {"queue": queue, "kind": kind}
    return REGISTRY.get_sample_value("outbox_farm_claim_errors_total", labels) or 0.0


async def empty(aconn: psycopg.AsyncConnection[Any], queue: str) -> bool:
    cursor = await aconn.execute("SELECT count(*) FROM outbox WHERE queue = %s", (queue,))
    row = await cursor.fetchone()
    assert row is not None
    return bool(row[0] == 0)


def test_a_queue_whose_claims_keep_failing_is_reported_counted_and_flagged(dsn: str) -> None:
    """A trigger (another writer's, say) refuses every claim of one queue."""
    stuck, flowing = qname("stuck"), qname("flowing")
    farm = Farm(dlq_table="outbox_dlq")
    handled: dict[str, set[int]] = {stuck: set(), flowing: set()}

    for queue in (stuck, flowing):

        @farm.handler(queue)
        async def handle(msg: Message) -> None:
            handled[msg.queue].add(msg.id)

    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
            await aconn.execute(
                "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                "IF NEW.queue = TG_ARGV[0] AND NEW.acquired_token IS NOT NULL THEN "
                "RAISE EXCEPTION 'claims of this queue are refused here'; END IF; "
                "RETURN NEW; END $$"
            )
            await aconn.execute(
                "CREATE TRIGGER refuse BEFORE UPDATE ON outbox FOR EACH ROW "
                f"EXECUTE FUNCTION refuse('{stuck}')"
            )
            stuck_ids = {await farm.apublish(aconn, {"n": n}, queue=stuck) for n in range(3)}
            async with farm.running(dsn, poll_interval=0.05) as rt:
                problem = await eventually(lambda: rt.problem, "the stall reported")
                assert stuck in problem
                assert "claims of this queue are refused here" in problem
                assert stalled(stuck) == 1
                assert claim_errors(stuck, "refused") >= fetcher.STALL_FAILURES
                # The other queue flows, and is not flagged.
                ids = {await farm.apublish(aconn, {"n": n}, queue=flowing) for n in range(3)}
                await eventually(lambda: handled[flowing] >= ids, "the other queue delivered")
                assert stalled(flowing) == 0
                assert claim_errors(flowing, "refused") == 0
                assert not handled[stuck]

                await aconn.execute("DROP TRIGGER refuse ON outbox")
                await eventually(lambda: handled[stuck] >= stuck_ids, "the stuck queue flows")
                await eventually(lambda: stalled(stuck) == 0, "the stall flag cleared")
                await eventually(lambda: rt.problem is None, "the problem cleared")
                await eventually(lambda: empty(aconn, stuck), "its rows acked")

    asyncio.run(scenario())


def test_a_ready_row_that_ages_while_the_worker_is_idle_is_a_stall(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row due for a while that the claims cannot take (here: locked by a transaction left
    open), while the worker holds nothing of its queue: the farm has room, yet it waits."""
    monkeypatch.setattr(fetcher, "STALL_OVERDUE", 1.0)
    queue = qname("aged")
    farm = Farm(dlq_table="outbox_dlq")
    handled: set[int] = set()

    @farm.handler(queue)
    async def handle(msg: Message) -> None:
        handled.add(msg.id)

    async def scenario() -> None:
        async with (
            await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn,
            await psycopg.AsyncConnection.connect(dsn) as locker,
        ):
            row_id = await farm.apublish(aconn, {}, queue=queue)
            await aconn.execute(
                "UPDATE outbox SET next_attempt_at = now() - interval '5 s' WHERE id = %s",
                (row_id,),
            )
            await locker.execute("SELECT 1 FROM outbox WHERE id = %s FOR UPDATE", (row_id,))
            async with farm.running(dsn, poll_interval=0.05) as rt:
                problem = await eventually(lambda: rt.problem, "the stall reported")
                assert f"queue {queue} stalled" in problem
                assert "oldest ready row" in problem
                assert stalled(queue) == 1
                assert not handled

                await locker.rollback()  # the row can be taken now: it is, and the stall ends
                await eventually(lambda: row_id in handled, "the row delivered")
                await eventually(lambda: stalled(queue) == 0, "the stall flag cleared")
                await eventually(lambda: rt.problem is None, "the problem cleared")

    asyncio.run(scenario())
