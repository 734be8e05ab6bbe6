"""What each row of a flush came to, counted for the observers and logged.

Its own module because it reads the store's answer, not the batch: the completer decides when
a batch is written and with what; this judges each row's result once the answer is in (the
results the completer's docstring lists) and counts the outcomes given up on without a write.
Its lines keep the completer's logger: to whoever filters logs by logger they are the
completer's writes (see `observe.logs`)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from functools import partial

from ... import storage
from ...errors import DatabaseError
from ...observe import Observer
from ...outcome import Outcome
from ...problems import Problems
from ..writes import Statement, write_for

log = logging.getLogger("outbox_farm.completer")


class Accounting:
    """Counts and logs the rows of the completer's writes by what became of them.

    `due` is told the queue and delay of each retry written, so that the queue's fetcher
    knows when its next row comes due."""

    def __init__(
        self,
        store: storage.Store,
        observer: Observer,
        problems: Problems,
        due: Callable[[str, float], None],
    ) -> None:
        self.store = store
        self.observer = observer
        self.problems = problems
        self.due = due

    def given_up(self, outcomes: list[Outcome]) -> None:
        """Count outcomes given up on without a write (each one is logged by its caller)."""
        counts = Counter((o.kind.value, o.queue) for o in outcomes)
        for (kind, queue), n in counts.items():
            self.observer.write_failed(kind, queue, n)

    def account(self, stmt: Statement, written: storage.Written) -> None:
        """Count the rows of `stmt` as `written` says they came out; a write that went through
        for any of them ends the problem its refusals were."""
        observer = self.observer
        phase = stmt.phase
        matched, refused = written.matched, written.refused
        if len(refused) < len(stmt.outcomes):
            self.problems.solved(f"{phase} write")
        dead_letters = phase == "terminal" and self.store.has_dlq
        outcomes = stmt.outcomes
        if phase == "ack" and len(matched) == len(outcomes):  # the common case, in one go
            queues = {outcome.queue for outcome in outcomes}
            if len(queues) == 1:
                done = Counter({queues.pop(): len(outcomes)})
            else:
                done = Counter(outcome.queue for outcome in outcomes)
        else:
            done = Counter()
            for n, outcome in enumerate(outcomes):
                if n in matched:
                    done[outcome.queue] += 1
                    if phase == "retry":
                        self.due(outcome.queue, outcome.delay)
                    elif dead_letters:
                        observer.dead_lettered(outcome)
                    continue
                error = refused.get(n) if refused else None
                if error is not None:
                    self._refused(phase, outcome, error)
                elif phase == "expire":
                    pass  # handed back because its lease ran short: losing it is expected
                elif n in written.unconfirmed:
                    observer.outcome_unconfirmed(phase, outcome)
                else:
                    observer.lease_lost(
                        phase, outcome.queue, outcome.row_id, outcome.deliveries_count
                    )
        for queue, count in done.items():
            observer.written(phase, queue, count)

    def _refused(self, phase: str, outcome: Outcome, exc: DatabaseError) -> None:
        queue = outcome.queue
        self.observer.write_failed(phase, queue, 1)
        fields = {"event": "write_failed", "phase": phase, "row_id": outcome.row_id, "queue": queue}
        probe = partial(self.store.refusal, write_for(phase, [], dlq=self.store.has_dlq))
        if self.problems.write_refused(phase, queue, exc, probe, log, fields):
            return  # logged, at most once a minute, as the problem it is
        hint = (
            " The DLQ table is missing or does not match: run `outbox-farm check`."
            if phase == "terminal" and self.store.has_dlq
            else ""
        )
        log.error(
            "%s write failed for row %s of queue %s: %s. The row stays in the outbox under its "
            "lease and is delivered again when the lease expires.%s",
            phase,
            outcome.row_id,
            queue,
            exc,
            hint,
            extra=fields,
        )
