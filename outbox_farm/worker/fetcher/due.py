"""When the fetcher's queue next has a row due, as far as the fetcher knows: from the retries
it was told of (`Fetcher.note_due`) and from its last next-due query (`Store.next_due`).

Its own module because two of the fetcher's waits end at those times, each its own way: the
look for the next NOTIFY after a claim (`look`) and the sleep after a claim that came back
short, once the next-due query answered (`after_query`). Both read the clock here, and the
store not at all: the fetcher asks the store, and decides which wait comes.
"""

from __future__ import annotations

import time

DUE_SLACK = 0.001  # wake a hair late rather than early: an early claim finds nothing


class DueTimes:
    """The earliest due times known, in monotonic time."""

    def __init__(self) -> None:
        self.noted: float | None = None  # the earliest due time of the retries told of
        self.found: float | None = None  # ... as the last next-due query found it

    def note(self, delay: float) -> bool:
        """A row becomes due in `delay` seconds (a retry just written); whether that is sooner
        than any retry known: a sleep under way must then end sooner."""
        due = time.monotonic() + delay
        if self.noted is None or due < self.noted:
            self.noted = due
            return True
        return False

    def look(self, longest: float, claimed_at: float, now: float) -> float:
        """How long the look for a NOTIFY after a claim sent at `claimed_at` may last at
        `now`: `longest`, or less when a row is due sooner. A row that was due before the
        claim was sent was the claim's to take, so its due time no longer cuts the look short
        (else one such time, never asked again, would send the query after every claim)."""
        window = longest
        for due in (self.noted, self.found):
            if due is not None and due > claimed_at:
                window = min(window, due - now)
        return window

    def after_query(self, poll: float, due: float | None) -> float:
        """Seconds to sleep after a next-due query that found a row due in `due` seconds (None:
        no row): `poll`, or until a hair after the earliest due time known. A retry's time
        once past is forgotten: from then on, the next-due query's answer covers its row."""
        self.found = time.monotonic() + due if due is not None else None
        wait = poll
        if due is not None:
            wait = min(wait, max(due, 0.0) + DUE_SLACK)
        if self.noted is not None:
            local = self.noted - time.monotonic()
            if local <= 0:
                self.noted = None
            wait = min(wait, max(local, 0.0) + DUE_SLACK)
        return wait
