"""A worker freezes the heap of its boot before it serves (`prefork.heap`): a full collection
of the cyclic GC then skips the modules, the app and the runtime, and stops the event loop for
a fraction of a millisecond instead of tens. Seen from a handler in a real `outbox-farm start`
worker: the frozen generation holds the boot's objects while rows are handled."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox_farm.prefork.heap import freeze_boot_heap
from tests.acceptance.test_farm import farm_process, scalar
from tests.steps import publish, wait_for

pytestmark = pytest.mark.slow

HEAPAPP = """\
import gc
import os

import psycopg

from outbox_farm import Farm, Message

farm = Farm(table="outbox", dlq_table="outbox_dlq")


@farm.handler("q", concurrency=4)
def handle(msg: Message) -> None:
    with psycopg.connect(os.environ["FARMAPP_DSN"], autocommit=True) as conn:
        conn.execute(
            "INSERT INTO heap_seen (id, pid, frozen) VALUES (%s, %s, %s)",
            (msg.id, os.getpid(), gc.get_freeze_count()),
        )
"""
# outbox_farm, psycopg and uvloop alone leave tens of thousands of objects after a boot.
LEAST_FROZEN = 10_000


def test_every_worker_serves_with_its_boot_heap_frozen(
    tmp_path: Path, dsn: str, conn: psycopg.Connection[Any]
) -> None:
    (tmp_path / "heapapp.py").write_text(HEAPAPP)
    conn.execute("CREATE TABLE heap_seen (id bigint NOT NULL, pid int NOT NULL, frozen int)")
    publish(conn, 40, queue="q")
    with farm_process(tmp_path, dsn, app="heapapp:farm") as farm:
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM heap_seen") >= 40, "40 rows", 60, farm)
        code, _ = farm.stop()
    assert code == 0, farm.log_tail()
    least = scalar(conn, "SELECT min(frozen) FROM heap_seen")
    assert least >= LEAST_FROZEN, f"a handler ran with only {least} objects frozen"


def test_freezing_collects_the_boots_garbage_first() -> None:
    """Garbage made before the freeze is collected, not frozen for the life of the process."""

    class Cycle:
        def __init__(self) -> None:
            self.me = self

    enabled = gc.isenabled()
    gc.disable()  # no automatic collection may take the cycle before the freeze does
    try:
        garbage = Cycle()
        alive = weakref.ref(garbage)
        del garbage
        assert alive() is not None
        assert freeze_boot_heap() > 0
        assert alive() is None, "the boot's garbage was frozen instead of collected"
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()
