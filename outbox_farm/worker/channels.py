"""The back-channels between each queue's fetcher and the completer, declared in one place.

Rows flow one way: the fetcher claims them into the inbox, the executors run them and hand
their outcomes to the completer, which writes them to the store. Four signals run against that
flow, and the runtime wires them once, every fetcher built, before anything starts
(`Completer.connect`; each fetcher is built with the completer as its `Flushing`):

    store ──claim──▶ Fetcher ──▶ inbox ──▶ Executors ──outcomes──▶ Completer ──flush──▶ store
                     ▲ ▲ ▲ │                                       ▲ │ │ │
                     │ │ │ └── starved: flush_now() ───────────────┘ │ │ │
                     │ │ └── settled: ledger.settle_all() ───────────┘ │ │
                     │ └── retry due: note_due(delay) ─────────────────┘ │
                     └── hand-over: handover(), handed() ────────────────┘

- starved (fetcher to completer): the queue is out of slots, which only written outcomes
  free: `flush_now` writes what waits without waiting for the flush interval.
- settled (completer to fetcher): a row whose outcome is written (or given up on) leaves the
  fetcher's in-flight `ledger`, which frees its slot and wakes a starved fetcher.
- retry due (completer to fetcher): a retry was written; `note_due` wakes the fetcher when it
  becomes due rather than at its next poll.
- hand-over (both ways): for an ack of keyed rows, the completer asks the fetcher for a claim
  to send with it (`handover`) and gives it the messages that claim took (`handed`).

Beside the signals, the completer asks each fetcher two questions when it decides whether an
outcome waits for its batch or is written at once (`Completer.awaited`): whether its next claim
waits for no write (`has_room`), and whether the queue runs under a running limit, whose places
only written outcomes free (`running_limited`).
"""

from __future__ import annotations

from typing import Protocol

from ..message import Message
from ..storage import Claim
from .inflight import Ledger


class Fetching(Protocol):
    """One queue's fetcher, as the completer sees it."""

    @property
    def ledger(self) -> Ledger:
        """The queue's rows in flight: the completer settles each row once it is written."""
        ...

    @property
    def hands_over(self) -> bool:
        """Whether an ack may claim the next rows of its keys for the queue (`handover`): not
        while an operator holds it, nor while its farm-wide limits apply (a hand-over claims
        outside them)."""
        ...

    @property
    def has_room(self) -> bool:
        """Whether the fetcher claims its next rows without waiting for a write: neither out of
        slots, nor held by an operator, nor claiming within farm-wide limits (a running limit
        waits for the queue's rows to be written)."""
        ...

    @property
    def running_limited(self) -> bool:
        """Whether the queue runs under a farm-wide running limit (`max_running`, or one per
        fair key): a place under it is free again only once its row's outcome is written."""
        ...

    def note_due(self, delay: float) -> None:
        """A row of the queue becomes due in `delay` seconds (a retry just written)."""
        ...

    def handover(self) -> Claim:
        """A claim of the next row of each key an ack deletes a row of, to send with it."""
        ...

    async def handed(self, claim: Claim, messages: list[Message], seconds: float) -> None:
        """What the hand-over `claim` took, `seconds` after the write it went with was sent."""
        ...


class Flushing(Protocol):
    """The completer, as a starved fetcher sees it."""

    def flush_now(self) -> None:
        """Write the outcomes waiting now, without waiting for the flush interval."""
        ...
