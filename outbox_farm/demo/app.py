"""The farm `outbox-farm demo` runs: one queue whose messages mostly succeed at once, some only
after a retry, and a few never (they end in the demo's DLQ), each after a millisecond of work."""

from __future__ import annotations

import asyncio

from .. import ConstantBackoff, DeadLetter, Farm, Message

TABLE, DLQ_TABLE, QUEUE = "outbox_demo", "outbox_demo_dlq", "demo"
FLAKY_EVERY = 50  # every 50th message fails its first attempt
POISON_EVERY = 1000  # and every 1000th (offset 7) fails for good

farm = Farm(table=TABLE, dlq_table=DLQ_TABLE)


@farm.handler(QUEUE, concurrency=64, retry=ConstantBackoff(0.2), max_deliveries=5)
async def handle(msg: Message) -> None:
    n = int(msg.json()["n"])
    await asyncio.sleep(0.001)  # the handler's I/O
    if n % POISON_EVERY == 7:
        raise DeadLetter(f"message {n} is a poison message, on purpose")
    if n % FLAKY_EVERY == 0 and msg.attempts_count == 0:
        raise RuntimeError(f"message {n} fails its first attempt, on purpose")
