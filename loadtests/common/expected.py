"""Publishing a message together with what must become of it.

The load test and the chaos suite publish the same way: in one transaction, the outbox row
and a `loadtest_expected` row (the message's id, queue and intended fate), so the checker
knows every committed message, and nothing of a rolled-back one.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import psycopg

from loadtests.common import scenario
from outbox_farm import Farm

EXPECT = (
    "INSERT INTO loadtest_expected (msg_id, queue, expect, fail_times, max_runs) "
    "VALUES (%s, %s, %s, %s, %s)"
)


def publish(
    conn: psycopg.Connection[Any],
    farm: Farm,
    queue: str,
    *,
    fail_times: int = 0,
    count: int = 1,
    expect: str | None = None,
    max_runs: int | None = None,
) -> list[dict[str, Any]]:
    """`count` messages of `queue` and their expectations, inside the caller's transaction;
    the bodies. `expect` and `max_runs` default to the queue's in `scenario.QUEUES` (a queue
    of another app must give them)."""
    spec = scenario.QUEUES.get(queue)
    fate = expect if expect is not None else spec.expect if spec else None
    runs = max_runs if max_runs is not None else spec.max_runs if spec else None
    if fate is None:
        raise ValueError(f"queue {queue!r} is not in scenario.QUEUES: give `expect`")
    bodies = [
        {
            "id": uuid.uuid4().hex,
            "queue": queue,
            "expect": fate,
            "fail_times": fail_times,
            "sent_at": time.time(),
        }
        for _ in range(count)
    ]
    with conn.cursor() as cur:
        cur.executemany(EXPECT, [(b["id"], queue, fate, fail_times, runs) for b in bodies])
    if count == 1:
        farm.publish(conn, bodies[0], queue=queue, headers={"loadtest": "1"})
    else:
        farm.publish_batch(conn, bodies, queue=queue, headers={"loadtest": "1"})
    return bodies
