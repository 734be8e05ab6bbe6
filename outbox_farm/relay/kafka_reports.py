"""librdkafka's answers as `Delivery`s: each record's delivery report, a record `produce`
refused at once, and one batch's reports gathered from the poller thread (`Reports`), with the
stall that tells a producer stuck on a broker that forgot it."""

from __future__ import annotations

import asyncio
import threading

from confluent_kafka import KafkaError, KafkaException

from .base import CONFIRMED, BrokerReply, Delivery

_UNROUTABLE = frozenset(
    {KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC, KafkaError._UNKNOWN_PARTITION}
)
_UNKNOWN = frozenset(
    {
        KafkaError._MSG_TIMED_OUT,
        KafkaError._TIMED_OUT,
        KafkaError._PURGE_QUEUE,
        KafkaError._PURGE_INFLIGHT,
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError._FATAL,
    }
)

_PRODUCER_STATE = frozenset(
    {
        KafkaError.PRODUCER_FENCED,
        KafkaError.INVALID_PRODUCER_EPOCH,
        KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER,
        KafkaError.UNKNOWN_PRODUCER_ID,
        KafkaError.INVALID_PRODUCER_ID_MAPPING,
    }
)
"""The idempotent producer's state was lost on the broker's side (not the record's fault): the
record counts as unconfirmed and the producer is made anew, with a fresh producer id."""


class Reports:
    """One batch's deliveries: filled by librdkafka's reports in the poller thread and by the
    loop for records refused before they were queued; `wait` returns when every one is known."""

    __slots__ = ("_done", "_left", "_lock", "_loop", "_results", "state_lost")

    def __init__(self, loop: asyncio.AbstractEventLoop, size: int) -> None:
        self._loop = loop
        self._results: list[Delivery | None] = [None] * size
        self._left = size
        self._lock = threading.Lock()
        self._done = asyncio.Event()
        self.state_lost = False  # a report said the producer's state is gone (_PRODUCER_STATE)

    def known(self, i: int, delivery: Delivery) -> None:
        self._results[i] = delivery

    def report(self, i: int, error: KafkaError | None, _msg: object) -> None:
        """librdkafka's delivery report of record `i` (poller thread)."""
        if error is None:
            self._results[i] = CONFIRMED
        else:
            self._results[i] = delivery(error)
            self.state_lost = self.state_lost or error.code() in _PRODUCER_STATE
        with self._lock:
            self._left -= 1
            finished = self._left == 0
        if finished:
            self._loop.call_soon_threadsafe(self._done.set)

    async def wait(self, settled: int, timeout: float, stall: float | None = None) -> bool:
        """Wait for the reports, `timeout` seconds at most; `settled` records got none (refused
        before being queued). False when none came for `stall` seconds: the producer is stuck."""
        with self._lock:
            self._left -= settled
            left = self._left
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while left:
            window = min(stall or timeout, deadline - loop.time())
            if window <= 0:
                return True  # librdkafka reports every record within its message timeout
            try:
                async with asyncio.timeout(window):
                    await self._done.wait()
                return True
            except TimeoutError:
                pass
            with self._lock:
                progress, left = left != self._left, self._left
            if stall is not None and window >= stall and left and not progress:
                return False
        return True

    def deliveries(self, lost_because: str = "no delivery report") -> list[Delivery]:
        lost = Delivery(BrokerReply.UNCONFIRMED, lost_because)
        return [lost if result is None else result for result in self._results]


def fatal(exc: Exception) -> bool:
    error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    return isinstance(error, KafkaError) and error.fatal()


def refused(exc: Exception) -> Delivery:
    """A record `produce` refused at once: as its delivery report would have said, when the
    exception carries librdkafka's error."""
    error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    if isinstance(error, KafkaError):
        return delivery(error)
    return Delivery(BrokerReply.NACKED, f"cannot be produced: {exc!r}")


def delivery(error: KafkaError) -> Delivery:
    """One failed delivery report, as a `Delivery` with the broker's (or librdkafka's) words."""
    code = error.code()
    if code in _UNROUTABLE:
        return Delivery(BrokerReply.RETURNED, f"no such topic: {words(error)}")
    if code in _UNKNOWN or code in _PRODUCER_STATE or error.retriable() or error.fatal():
        return Delivery(BrokerReply.UNCONFIRMED, words(error))
    return Delivery(BrokerReply.NACKED, f"refused by the broker: {words(error)}")


def words(error: KafkaError | Exception) -> str:
    """`Broker: Message size too large (MSG_SIZE_TOO_LARGE)`, from librdkafka's error or an
    exception carrying one; any other exception as itself."""
    if isinstance(error, Exception):
        inner = error.args[0] if error.args else None
        if not isinstance(inner, KafkaError):
            return repr(error)
        error = inner
    return f"{error.str()} ({error.name()})"
