"""The fleet each farm host runs in the fleet scenario:
`outbox-farm start loadtests.scale.fleetapp:fleet --dsn HOME`.

One farm (the load test's tables, one queue `work`) served in every database of the home
database's `tenants(name, dsn)` catalog. The handler notes every run in a journal file of its
own process on the host's disk, not in a database: a database host that is cut off must not
hold up the runs of the other host's databases, and a line per run costs the machine far
less than a row per run. The harness reads the journals as the ledger of the run.

`idle` is the same fleet under another name over a catalog that lists nothing: a worker of it
is what a worker weighs when it serves no database, the baseline of the memory per database.

Set by the harness, per host, in the environment:

    FLEETAPP_HOST       the host's name, written in every journal line
    FLEETAPP_JOURNAL    the directory of the journals
    FLEETAPP_LEASE      the fleet's lease of a database, seconds (default 6)
    FLEETAPP_RECHECK    seconds between two readings of the catalog (default 2)
    FLEETAPP_ROW_LEASE  the queue's lease_ttl of a claimed row, seconds (default 10)
"""

from __future__ import annotations

import os
import time

import orjson

from loadtests.common import tables
from loadtests.scale.journal_file import journal as open_journal
from outbox_farm import Farm, Message
from outbox_farm.fleet import Fleet

HOST = os.environ.get("FLEETAPP_HOST", "host")
JOURNAL = os.environ.get("FLEETAPP_JOURNAL", "")
QUEUE = "work"
CATALOG = "SELECT name, dsn FROM tenants"

farm = Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)


@farm.handler(QUEUE, lease_ttl=float(os.environ.get("FLEETAPP_ROW_LEASE", "10")))
async def handle(msg: Message) -> None:
    """Journal the run as it ends: a line means the handler finished and asked for its ack;
    the message's database is in its body, so a line says which database's row ran where."""
    started = time.time()
    journal = open_journal(JOURNAL, HOST)
    if journal is not None:
        body = orjson.loads(msg.body)
        journal.write(
            f"{body.get('id', '')}\t{body.get('db', '')}\t{started:.6f}\t{time.time():.6f}\t"
            f"{os.getpid()}\t{HOST}\n"
        )


fleet = Fleet(
    farm,
    catalog=CATALOG,
    lease=float(os.environ.get("FLEETAPP_LEASE", "6")),
    recheck=float(os.environ.get("FLEETAPP_RECHECK", "2")),
)
idle = Fleet(farm, catalog=f"{CATALOG} WHERE false", name="idle")
