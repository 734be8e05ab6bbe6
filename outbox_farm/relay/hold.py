"""Holding rows through a downstream's outage, their attempts intact.

A row that no one answered for is not at fault: the broker was down, dropped the connection, or
forgot the producer that sent it. Spending the row's attempts on that would walk a whole backlog
to the DLQ during one long outage, so the relay holds such rows (leased; the heartbeat renews
them) and sends them again over a new connection, with a jittered, doubling wait between
fruitless rounds. `Backoff` is that wait; `Held` is one batch's bookkeeping of what it holds and
whose fault a missing answer is.

Only a row's own fault may cost it an attempt: a row is judged at fault when it stays
unanswered twice on a connection made anew while the broker answered others (a message the
broker closes the connection for, say). A round of several rows that all failed blames none of
them; the rounds after it probe with one row, then twice as many after each answered round, so
that such a row soon travels alone. A row once judged at fault stays a suspect (`Suspects`):
claimed again, alone perhaps, it spends an attempt at its first failure on a new connection, so
it walks to the DLQ under its retry strategy instead of holding the relay for ever.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterable, Sequence

FIRST_WAIT = 0.2  # seconds before the first retry; doubled up to WAIT_CAP
# Five seconds at most between fruitless rounds: a broker back from a restart is found within
# about that (one reconnect every few seconds costs an outage nothing), where 15 s made the
# first round after a restart wait up to 15 s, half the time a restarted broker has to catch up.
WAIT_CAP = 5.0
STRIKES = 2  # unanswered rounds on new connections, with the broker confirming others meanwhile
SUSPECTS = 4096  # row ids remembered as at fault, per relay and process


class Backoff:
    """A jittered, doubling wait: `FIRST_WAIT` up to `WAIT_CAP`, back to the first after
    `reset()` (the downstream answered)."""

    __slots__ = ("_delay",)

    def __init__(self) -> None:
        self._delay = FIRST_WAIT

    async def wait(self) -> None:
        await asyncio.sleep(self._delay * random.uniform(0.5, 1.0))
        self._delay = min(self._delay * 2, WAIT_CAP)

    def reset(self) -> None:
        self._delay = FIRST_WAIT


class Suspects:
    """Ids of rows judged at fault, the latest `SUSPECTS` of them (a relay's, in one process:
    written by its batches, on one event loop)."""

    __slots__ = ("_ids",)

    def __init__(self) -> None:
        self._ids: dict[int, None] = {}

    def __contains__(self, row_id: object) -> bool:
        return row_id in self._ids

    def __bool__(self) -> bool:
        return bool(self._ids)

    def add(self, row_id: int) -> None:
        self._ids[row_id] = None
        if len(self._ids) > SUSPECTS:
            del self._ids[next(iter(self._ids))]


class Held:
    """Which rows of one batch (by index, in claim order) still have no answer, and each one's
    strikes. Written and read by the one call that publishes the batch.

    `since` and `confirms` count the rows the relay confirmed, in any batch: `since` before
    the batch was first sent (every row of it went out then), `confirms` after each round, so
    that "the broker confirmed others meanwhile" needs no state shared beyond that count.
    """

    __slots__ = ("_since", "_size", "_strikes", "rows")

    def __init__(self, size: int, since: int, suspects: Iterable[int] = ()) -> None:
        self.rows = list(range(size))  # the first round sent them all
        self._since = since
        # A suspect (judged at fault in an earlier claim) is at fault at its first strike.
        self._strikes = dict.fromkeys(suspects, STRIKES - 1)
        self._size: int | None = None  # rows a round sends: all of them, or a probe's few

    def next_round(self) -> list[int]:
        """The rows to send now: every held row, or the first few while probing."""
        return list(self.rows) if self._size is None else self.rows[: self._size]

    def record(
        self, sent: Sequence[int], failed: Sequence[int], *, anew: bool, confirms: int
    ) -> list[int]:
        """Record a round: `sent` went out (on a connection made anew for it, when `anew`),
        `failed` of them got no answer, and the relay had confirmed `confirms` rows after it.
        Returns the failed rows judged at fault (to spend an attempt); the others stay held.

        A failure is a strike only when it is the row's own: on a new connection, while the
        broker answered others (in this round, or since the batch was first sent for a row
        sent alone). A round of several rows that all failed says nothing of any one of them:
        the next rounds probe, one row, then twice as many after each answered round, so that
        a row the broker fails on is soon alone in its round."""
        answered = len(sent) > len(failed)
        alone = len(sent) == 1
        at_fault = []
        for row in failed:
            strikes = self._strikes.get(row, 0)
            if anew and (answered or (alone and (confirms > self._since or strikes))):
                self._strikes[row] = strikes = strikes + 1
                if strikes >= STRIKES:
                    at_fault.append(row)
        still = set(failed).difference(at_fault)
        done = set(sent) - still
        self.rows = [row for row in self.rows if row not in done]
        if answered:
            size = None if self._size is None else self._size * 2
            self._size = None if size is None or size >= len(self.rows) else size
        elif alone and self.rows and self.rows[0] in still:
            self.rows.append(self.rows.pop(0))  # a failed probe waits behind the others
        elif anew:
            self._size = 1
        return at_fault
