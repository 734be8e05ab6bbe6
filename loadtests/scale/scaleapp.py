"""The farm each farm host runs: `outbox-farm start loadtests.scale.scaleapp:farm`.

One queue, `work`, whose handler optionally sleeps (so that rows are in flight when a host is
cut off) and notes every run in a journal file of its own process, on the host's disk, instead
of the database: a handler whose record went to the database would hang with the partitioned
host's every other write, so the host's late acks would never be the handler's. The harness
loads the journals into `loadtest_ledger` after the drain (`journal.py`), so the load test's
checker reads them as it reads any run.

Set by the harness, per host, in the environment:

    SCALE_HOST         the host's name, written in every journal line
    SCALE_JOURNAL      the directory of the journals; empty: none (the scale curve's no-op)
    SCALE_SLEEP        "lo,hi": each run sleeps a uniform lo..hi seconds (default 0)
    SCALE_LEASE_TTL    the queue's lease_ttl, seconds (default the farm's, 60)
    SCALE_CONCURRENCY  handler runs at once per process (default the farm's, 32)
    SCALE_PREFETCH     claimed rows buffered beyond those (default: as many as concurrency)
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import orjson

from loadtests.common import tables
from loadtests.scale.journal_file import journal as open_journal
from outbox_farm import Farm, Message

HOST = os.environ.get("SCALE_HOST", "host")
JOURNAL = os.environ.get("SCALE_JOURNAL", "")
_lo, _, _hi = os.environ.get("SCALE_SLEEP", "0,0").partition(",")
SLEEP = (float(_lo or 0), float(_hi or _lo or 0))
QUEUE = "work"

farm = Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)


def _options() -> dict[str, object]:
    options: dict[str, object] = {}
    if os.environ.get("SCALE_LEASE_TTL"):
        options["lease_ttl"] = float(os.environ["SCALE_LEASE_TTL"])
    if os.environ.get("SCALE_CONCURRENCY"):
        options["concurrency"] = int(os.environ["SCALE_CONCURRENCY"])
    if os.environ.get("SCALE_PREFETCH"):
        options["prefetch"] = int(os.environ["SCALE_PREFETCH"])
    return options


@farm.handler(QUEUE, **_options())  # type: ignore[arg-type]
async def handle(msg: Message) -> None:
    """Note the start first thing (the lag is measured to it), sleep, then journal the run
    just before returning: a journal line means the handler finished and asked for its ack."""
    started = time.time()
    if SLEEP[1] > 0:
        await asyncio.sleep(random.uniform(*SLEEP))
    journal = open_journal(JOURNAL, HOST)
    if journal is not None:
        msg_id = orjson.loads(msg.body).get("id", "")
        journal.write(f"{msg_id}\t{started:.6f}\t{time.time():.6f}\t{os.getpid()}\t{HOST}\n")
