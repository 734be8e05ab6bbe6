"""The farm of the breaker-outage scenario: a queue whose downstream goes down, behind a
breaker, beside a queue held to a farm-wide rate.

    ok     succeeds (the steady load that must keep flowing)
    down   calls the "downstream": down while the file named by BREAKERAPP_DOWN exists, when
           the run fails as a refused connection would; behind a `Breaker` of
           BREAKERAPP_FAILURES failures (default 5) and a probe every BREAKERAPP_PROBE_EVERY
           seconds (default 2)
    rated  succeeds; the scenario limits it farm-wide (`outbox_farm.admin.limit_queue`)

`down`'s retry strategy gives a row MAX_ATTEMPTS attempts half a second apart: without the
breaker every row caught by the outage would be dead-lettered within two seconds, so a DLQ
left empty says the breaker held the queue. Every run is recorded in the load test's ledger
first, as `farmapp` does (a failed one as `error`).
"""

from __future__ import annotations

import os

from loadtests.common import tables
from loadtests.common.farmapp import record
from outbox_farm import Breaker, ConstantBackoff, Farm, Message

FAILURES = int(os.environ.get("BREAKERAPP_FAILURES", "5"))
PROBE_EVERY = float(os.environ.get("BREAKERAPP_PROBE_EVERY", "2"))
MAX_ATTEMPTS = 3  # attempts a row of `down` gets before the DLQ

DOWN = os.environ.get("BREAKERAPP_DOWN")
if not DOWN:
    raise RuntimeError("set BREAKERAPP_DOWN (the file whose presence means the downstream is down)")

farm = Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)


@farm.handler("ok")
async def succeeds(msg: Message) -> None:
    await record(msg, "success")


@farm.handler(
    "down",
    breaker=Breaker(failures=FAILURES, probe_every=PROBE_EVERY),
    retry=ConstantBackoff(delay=0.5, max_attempts=MAX_ATTEMPTS),
)
async def calls_downstream(msg: Message) -> None:
    if os.path.exists(str(DOWN)):  # noqa: ASYNC240 - one stat of a local file, the outage
        await record(msg, "error")
        raise ConnectionRefusedError("downstream refused the connection")
    await record(msg, "success")


@farm.handler("rated")
async def limited(msg: Message) -> None:
    await record(msg, "success")
