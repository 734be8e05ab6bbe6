"""What a test drain reports: one `Run` per verdict, in the order they were reached."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..decision import Notes
from ..message import Message
from ..observe import Observer
from ..outcome import Kind, Outcome, Reason


class Status(enum.StrEnum):
    """What became of a row after one run (or, for `max_deliveries`, instead of one)."""

    ACKED = "acked"  # deleted: the handler succeeded
    RETRIED = "retried"  # back in the outbox, due after `delay`
    DEAD_LETTERED = "dead_lettered"  # failed for good: in the DLQ (deleted if the farm has none)
    HANDED_BACK = "handed_back"  # not run: its lease ran short while it waited


_STATUS = {
    Kind.ACK: Status.ACKED,
    Kind.RETRY: Status.RETRIED,
    Kind.TERMINAL: Status.DEAD_LETTERED,
    Kind.RELEASE: Status.HANDED_BACK,
    Kind.EXPIRE: Status.HANDED_BACK,
}


@dataclass(frozen=True, slots=True)
class Run:
    """One verdict on `message`: its `status`, the DLQ `reason` when dead-lettered, the
    exception the run failed with (None for a success, or a row given up on unrun), and for
    a retry the seconds until its next attempt."""

    message: Message
    status: Status
    reason: Reason | None = None
    error: BaseException | None = None
    delay: float | None = None

    @property
    def queue(self) -> str:
        return self.message.queue

    @property
    def id(self) -> int:
        return self.message.id

    @classmethod
    def of(cls, msg: Message, outcome: Outcome) -> Run:
        status = _STATUS[outcome.kind]
        return cls(
            msg,
            status,
            outcome.reason,
            None,
            outcome.delay if status is Status.RETRIED else None,
        )


@dataclass
class Drained:
    """Every run of a drain, in order; iterable and sized like the list of them.

    `left`: rows of the drained queues still in the outbox at the end (due later than the
    drain's `within`, or not reached before its `limit`). `advanced`: seconds the drain moved
    the clock forward to run rows that were not due yet.
    """

    runs: list[Run] = field(default_factory=list)
    left: int = 0
    advanced: float = 0.0

    def __iter__(self) -> Iterator[Run]:
        return iter(self.runs)

    def __len__(self) -> int:
        return len(self.runs)

    def of(self, queue: str) -> list[Run]:
        return [run for run in self.runs if run.queue == queue]

    def _with(self, status: Status) -> list[Run]:
        return [run for run in self.runs if run.status is status]

    @property
    def acked(self) -> list[Run]:
        return self._with(Status.ACKED)

    @property
    def retried(self) -> list[Run]:
        return self._with(Status.RETRIED)

    @property
    def dead_lettered(self) -> list[Run]:
        return self._with(Status.DEAD_LETTERED)

    @property
    def statuses(self) -> list[str]:
        """The status of every run as text, in order: handy in an assert."""
        return [str(run.status) for run in self.runs]


class Collector(Observer):
    """Turns the runtime's verdicts into `Run`s: `decided` gives the outcome, `noted` (called
    right after it when there is something to say) the exception behind it."""

    def __init__(self) -> None:
        self.runs: list[Run] = []
        self._last: dict[int, int] = {}  # id(message) -> index of its latest run

    def decided(self, msg: Message, outcome: Outcome) -> None:
        self._last[id(msg)] = len(self.runs)
        self.runs.append(Run.of(msg, outcome))

    def noted(self, msg: Message, notes: Notes) -> None:
        errors = [note.error for note in notes if note.error is not None]
        index = self._last.get(id(msg))
        if errors and index is not None:
            self.runs[index] = dataclasses.replace(self.runs[index], error=errors[-1])
