"""Publishing: outbox rows written inside the caller's own transaction.

The producer never commits, never opens a transaction and never takes a connection of its
own: the row (and its NOTIFY, which Postgres delivers only at commit) shares the fate of the
caller's domain writes. Arguments are validated completely before any SQL is sent, so a bad
call leaves the caller's transaction untouched.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Literal, Required, TypedDict, Unpack

import orjson

from .db.connect import AsyncConnection, Connection
from .db.publish import Due, NewBatch, NewRow, Publisher
from .errors import ConfigurationError
from .message import CONTENT_TYPE, CORRELATION_ID
from .observe import tracing
from .queries import Queries

TimerConflict = Literal["ignore", "extend"]
MAX_NAME = 255  # queue and timer_id are varchar(255)
MAX_PRIORITY = 32767  # the column is a smallint; 0, the default, is the lowest


def encode_body(body: object) -> tuple[bytes, str]:
    """Bytes as they are, text as UTF-8, anything else as JSON (orjson), with its content type."""
    if isinstance(body, bytes | bytearray | memoryview):
        return bytes(body), "application/octet-stream"
    if isinstance(body, str):
        return body.encode("utf-8"), "text/plain; charset=utf-8"
    try:
        return orjson.dumps(body), "application/json"
    except TypeError as exc:
        raise ConfigurationError(f"body cannot be encoded as JSON: {exc}") from None


def _check_name(value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"{what} must be a non-empty string, got {value!r}")
    if len(value) > MAX_NAME:
        raise ConfigurationError(f"{what} is {len(value)} characters; at most {MAX_NAME}")
    if "\x00" in value:
        raise ConfigurationError(f"{what} contains a NUL character (\\x00): {value!r}")
    return value


def _nul_at(value: object, where: str) -> str | None:
    """Where in a decoded JSON value a NUL character sits (`headers['a'][0]`), if anywhere."""
    if isinstance(value, str):
        return where if "\x00" in value else None
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{where}[{key!r}]"
            if "\x00" in key:
                return f"the key {inner}"
            if found := _nul_at(item, inner):
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if found := _nul_at(item, f"{where}[{index}]"):
                return found
    return None


def _delay_seconds(activate_in: float | timedelta | None) -> float:
    if activate_in is None:
        return 0.0
    seconds = activate_in.total_seconds() if isinstance(activate_in, timedelta) else activate_in
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise ConfigurationError(f"activate_in must be seconds or a timedelta, got {seconds!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigurationError(f"activate_in must be finite and >= 0, got {seconds!r}")
    return float(seconds)


def encode_headers(
    headers: Mapping[str, Any] | None,
    correlation_id: str | None,
    content_type: str,
    trace: bool = False,
) -> str:
    """The row's headers as JSON text: the caller's, with `content_type`, a correlation id
    (the given one, else the caller's header, else a new random one) and, with `trace`, the
    current trace context (`traceparent`)."""
    if headers is not None and not isinstance(headers, Mapping):
        raise ConfigurationError(f"headers must be a mapping, got {type(headers).__name__}")
    merged: dict[str, Any] = {CONTENT_TYPE: content_type, **(headers or {})}
    if trace:
        tracing.inject(merged)
    if correlation_id is not None:
        merged[CORRELATION_ID] = _check_name(correlation_id, "correlation_id")
    if "correlation_id" not in merged:
        merged["correlation_id"] = os.urandom(16).hex()  # a random id, 4x cheaper than uuid4
    try:
        text = orjson.dumps(merged).decode()
    except TypeError as exc:
        raise ConfigurationError(f"headers cannot be encoded as JSON: {exc}") from None
    # jsonb cannot hold U+0000: the server would refuse the row and abort the caller's
    # transaction. The substring test is the cheap common case (it also matches an escaped
    # backslash before "u0000"); the walk over the decoded text, whatever types went in,
    # decides and names the culprit.
    if "\\u0000" in text and (where := _nul_at(orjson.loads(text), "headers")):
        raise ConfigurationError(
            f"{where} contains a NUL character (\\x00), which Postgres jsonb cannot store; "
            "remove it or encode the value (e.g. base64)"
        )
    return text


def check_priority(priority: object) -> int:
    """A priority as the claim ranks it: an int from 0 (the default, the lowest) to 32767.

    Only an int: a float or a bool is refused rather than rounded, and a negative value too,
    since "below the default" is what every other row is to one above 0 (the claim's priority
    index holds only rows above 0; see migration 0013)."""
    if type(priority) is not int:
        raise ConfigurationError(
            f"priority must be an int from 0 to {MAX_PRIORITY}, got {priority!r}"
            f" ({type(priority).__name__})"
        )
    if not 0 <= priority <= MAX_PRIORITY:
        raise ConfigurationError(
            f"priority must be from 0 (the default, the lowest) to {MAX_PRIORITY}, got"
            f" {priority}; to put rows behind others, give the others a higher priority"
        )
    return priority


def _due(activate_in: float | timedelta | None, activate_at: datetime | None) -> Due:
    if activate_in is not None and activate_at is not None:
        raise ConfigurationError("pass activate_in or activate_at, not both")
    if activate_at is not None:
        if not isinstance(activate_at, datetime):
            raise ConfigurationError(f"activate_at must be a datetime, got {activate_at!r}")
        if activate_at.tzinfo is None or activate_at.utcoffset() is None:
            raise ConfigurationError(
                "activate_at must be timezone-aware (e.g. datetime.now(timezone.utc)); "
                "a naive time would be read in the database session's time zone"
            )
    return Due(activate_at, _delay_seconds(activate_in))


def _batch_keys(
    count: int, key: str | None, keys: Sequence[str | None] | None
) -> list[str | None] | None:
    """One ordering key per row of a batch, or None when no row has one."""
    if keys is None:
        return None if key is None else [_check_name(key, "ordering_key")] * count
    if key is not None:
        raise ConfigurationError("pass ordering_key (one for all rows) or ordering_keys, not both")
    if isinstance(keys, str | bytes) or not isinstance(keys, Sequence):
        raise ConfigurationError("ordering_keys takes a sequence with one key (or None) per body")
    if len(keys) != count:
        raise ConfigurationError(
            f"ordering_keys has {len(keys)} keys for {count} bodies; give one per body"
        )
    return [None if k is None else _check_name(k, "ordering_key") for k in keys]


class _RowOptions(TypedDict, total=False):
    """Options of every publish call."""

    queue: Required[str]
    headers: Mapping[str, Any] | None  # merged with content-type and a fresh correlation_id
    activate_in: float | timedelta | None  # seconds (or timedelta) from the database's now()
    activate_at: datetime | None  # timezone-aware; exclusive with activate_in
    notify: bool | None  # None: the Farm's setting
    # Rows of one queue with the same key are handled one at a time, oldest first, across
    # every process; a failing row holds back the later rows of its key until it is acked or
    # dead-lettered. None: no order (the default, and the fastest).
    ordering_key: str | None
    # Among the queue's due rows, higher first: 0 (the default, the lowest) to 32767. A claim
    # takes at most three quarters of its rows by priority, the rest in plain due order, so
    # rows of priority 0 keep moving under any load of higher ones. An ordering key's order
    # comes first: a row waits for the older rows of its key, whatever their priorities.
    priority: int
    # The tenant (a customer, any group) the row belongs to, at most 255 characters: a queue
    # limited per key (`outbox-farm queue limit QUEUE --per-key-running N`) runs at most N rows
    # of each fair key at once, so one tenant's backlog holds back no other tenant. None: no
    # tenant (such rows count as one key of their own). Needs migration 0014.
    fair_key: str | None


class BatchOptions(_RowOptions, total=False):
    """Options of `publish_batch`: every row of the batch shares them, but for
    `ordering_keys`, one key (or None) per body, instead of one `ordering_key` for all."""

    ordering_keys: Sequence[str | None] | None


class PublishOptions(_RowOptions, total=False):
    """Options of `publish`."""

    correlation_id: str | None  # kept in headers; a random one when absent
    timer_id: str | None  # at most one live row per (queue, timer_id)
    on_timer_conflict: TimerConflict  # "ignore" keeps the live timer, "extend" moves it


class Producer:
    """Validates and encodes publish calls for one outbox table; `Publisher` runs them."""

    def __init__(self, queries: Queries, *, notify: bool = True, trace: bool = False) -> None:
        self.queries = queries
        self.notify = notify
        self.trace = trace
        self._publisher = Publisher(queries)

    def build_row(
        self,
        body: object,
        *,
        queue: str,
        headers: Mapping[str, Any] | None = None,
        correlation_id: str | None = None,
        activate_in: float | timedelta | None = None,
        activate_at: datetime | None = None,
        timer_id: str | None = None,
        on_timer_conflict: TimerConflict = "ignore",
        notify: bool | None = None,
        ordering_key: str | None = None,
        priority: int = 0,
        fair_key: str | None = None,
    ) -> tuple[NewRow, bool]:
        """One publish call checked and encoded, not written: the row `publish` inserts and
        whether it notifies. Public for `outbox_farm.testing`, which keeps such rows in memory."""
        _check_name(queue, "queue")
        if timer_id is not None:
            _check_name(timer_id, "timer_id")
        if ordering_key is not None:
            _check_name(ordering_key, "ordering_key")
        if priority != 0 or type(priority) is not int:
            check_priority(priority)
        if fair_key is not None:
            _check_name(fair_key, "fair_key")
        if on_timer_conflict not in ("ignore", "extend"):
            raise ConfigurationError(
                f"on_timer_conflict must be 'ignore' or 'extend', got {on_timer_conflict!r}"
            )
        due = _due(activate_in, activate_at)
        payload, content_type = encode_body(body)
        row = NewRow(
            queue,
            payload,
            encode_headers(headers, correlation_id, content_type, self.trace),
            due,
            timer_id,
            on_timer_conflict == "extend",
            ordering_key,
            priority,
            fair_key,
        )
        return row, self.notify if notify is None else notify

    def build_batch(
        self,
        bodies: Sequence[object],
        *,
        queue: str,
        headers: Mapping[str, Any] | None = None,
        activate_in: float | timedelta | None = None,
        activate_at: datetime | None = None,
        notify: bool | None = None,
        ordering_key: str | None = None,
        ordering_keys: Sequence[str | None] | None = None,
        priority: int = 0,
        fair_key: str | None = None,
    ) -> tuple[NewBatch, bool]:
        """`build_row` for `publish_batch`; `priority` and `fair_key` are every row's."""
        _check_name(queue, "queue")
        if priority != 0 or type(priority) is not int:
            check_priority(priority)
        if fair_key is not None:
            _check_name(fair_key, "fair_key")
        if isinstance(bodies, str | bytes) or not isinstance(bodies, Sequence):
            raise ConfigurationError("publish_batch takes a sequence (list or tuple) of bodies")
        due = _due(activate_in, activate_at)
        payloads, header_texts = [], []
        for body in bodies:
            payload, content_type = encode_body(body)
            payloads.append(payload)
            header_texts.append(encode_headers(headers, None, content_type, self.trace))
        keys = _batch_keys(len(payloads), ordering_key, ordering_keys)
        batch = NewBatch(queue, payloads, header_texts, due, keys, priority, fair_key)
        return batch, self.notify if notify is None else notify

    # The public calls come in sync/async pairs over the same builders above. Options are
    # listed in PublishOptions.

    def publish(
        self, conn: Connection, body: object, **options: Unpack[PublishOptions]
    ) -> int | None:
        """Insert one row in the caller's transaction; return its id.

        None means a timer with this `timer_id` already exists and was kept (`ignore`), or is
        running and could not be moved (`extend`). The caller commits or rolls back.
        """
        row, notify = self.build_row(body, **options)
        return self._publisher.insert(conn, row, notify=notify)

    async def apublish(
        self, conn: AsyncConnection, body: object, **options: Unpack[PublishOptions]
    ) -> int | None:
        """`publish` for an `AsyncConnection`."""
        row, notify = self.build_row(body, **options)
        return await self._publisher.ainsert(conn, row, notify=notify)

    def publish_batch(
        self, conn: Connection, bodies: Sequence[object], **options: Unpack[BatchOptions]
    ) -> list[int]:
        """Insert many rows of one queue in one round trip; ids in the order of `bodies`.

        Each row gets its own correlation id. At most one NOTIFY is sent for the batch.
        """
        batch, notify = self.build_batch(bodies, **options)
        return self._publisher.insert_batch(conn, batch, notify=notify)

    async def apublish_batch(
        self, conn: AsyncConnection, bodies: Sequence[object], **options: Unpack[BatchOptions]
    ) -> list[int]:
        """`publish_batch` for an `AsyncConnection`."""
        batch, notify = self.build_batch(bodies, **options)
        return await self._publisher.ainsert_batch(conn, batch, notify=notify)

    def cancel_timer(self, conn: Connection, *, queue: str, timer_id: str) -> bool:
        """Delete a pending timer; False if there is none or its handler is already running."""
        return self._publisher.cancel_timer(
            conn, _check_name(queue, "queue"), _check_name(timer_id, "timer_id")
        )

    async def acancel_timer(self, conn: AsyncConnection, *, queue: str, timer_id: str) -> bool:
        """`cancel_timer` for an `AsyncConnection`."""
        return await self._publisher.acancel_timer(
            conn, _check_name(queue, "queue"), _check_name(timer_id, "timer_id")
        )
