"""Steady scripted load: publisher threads committing outbox rows with their expectations.

Scripted rather than Locust so that a scenario can change the rate mid-run (the overload
scenario) and knows exactly what it committed; each transaction is the same as a Locust
user's (`loadtests.expected`), several messages at a time at high rates.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import psycopg

from loadtests.common import expected, tables
from outbox_farm import Farm

PRODUCER = Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)


class Load:
    """`rate` messages per second over `weights` (queue -> share) into `dsn`, from `threads`
    connections, until `stop()`; a failed transaction (the database restarting, a terminated
    connection) is retried on a new connection, as an application would.

    `expect` maps queues of another app to their expected fate (DLQ reason or success)."""

    def __init__(
        self,
        dsn: str,
        rate: float,
        weights: dict[str, float],
        *,
        threads: int = 2,
        expect: dict[str, tuple[str, int | None]] | None = None,
        flaky_failures: int = 1,
    ) -> None:
        self.dsn, self.rate, self.weights = dsn, rate, weights
        self.expect = expect or {}
        self.flaky_failures = flaky_failures
        self.committed = 0
        self.failed = 0
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, name=f"chaos-load-{i}", daemon=True)
            for i in range(threads)
        ]

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> int:
        """Stop publishing; the messages committed in all."""
        self._halt.set()
        for thread in self._threads:
            thread.join(timeout=30)
        return self.committed

    def _run(self) -> None:
        queues, shares = list(self.weights), list(self.weights.values())
        conn: psycopg.Connection[Any] | None = None
        next_at = time.monotonic()
        while not self._halt.is_set():
            per_thread = self.rate / len(self._threads)
            batch = max(1, int(per_thread / 50))  # ~50 transactions per second per thread
            next_at += batch / per_thread
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = psycopg.connect(self.dsn, application_name="chaos-load")
                queue = random.choices(queues, shares)[0]
                fate = self.expect.get(queue, (None, None))
                with conn.transaction():
                    expected.publish(
                        conn,
                        PRODUCER,
                        queue,
                        count=batch,
                        fail_times=self.flaky_failures if queue == "flaky" else 0,
                        expect=fate[0],
                        max_runs=fate[1],
                    )
                with self._lock:
                    self.committed += batch
            except psycopg.Error:
                with self._lock:
                    self.failed += 1
                if conn is not None:
                    conn.close()
                conn = None
                self._halt.wait(0.2)
            delay = next_at - time.monotonic()
            if delay > 0:
                self._halt.wait(delay)
            else:
                next_at = time.monotonic()  # behind: do not burst to catch up
        if conn is not None:
            conn.close()
