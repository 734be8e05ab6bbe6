"""Producer argument errors are raised before any SQL is sent; body and header encoding."""

from __future__ import annotations

import asyncio
import math
import re
from datetime import UTC, date, datetime, timedelta
from typing import Any

import orjson
import pytest

from outbox_farm import Farm
from outbox_farm.errors import ConfigurationError
from outbox_farm.producer import encode_body, encode_headers


class NoSQLConnection:
    """Stands where a psycopg connection goes; fails the test if any statement is sent."""

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("SQL was sent")


class NoSQLAsyncConnection:
    async def execute(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("SQL was sent")


CONN: Any = NoSQLConnection()
ACONN: Any = NoSQLAsyncConnection()


@pytest.fixture
def farm() -> Farm:
    return Farm("outbox", "outbox_dlq")


# --- the stub really catches SQL: a valid call reaches it ----------------------------------


def test_valid_publish_reaches_the_connection(farm: Farm) -> None:
    with pytest.raises(AssertionError, match="SQL was sent"):
        farm.publish(CONN, b"x", queue="q" * 255, timer_id="t" * 255, activate_in=0)


def test_valid_batch_reaches_the_connection(farm: Farm) -> None:
    with pytest.raises(AssertionError, match="SQL was sent"):
        farm.publish_batch(CONN, (b"x", "y", {"z": 1}), queue="q")


# --- queue and timer_id ---------------------------------------------------------------------


@pytest.mark.parametrize("queue", ["", None, 7, b"q"])
def test_bad_queue_is_refused(farm: Farm, queue: Any) -> None:
    with pytest.raises(ConfigurationError, match="queue must be a non-empty string"):
        farm.publish(CONN, b"x", queue=queue)


def test_queue_over_255_characters_is_refused(farm: Farm) -> None:
    with pytest.raises(ConfigurationError, match="queue is 256 characters; at most 255"):
        farm.publish(CONN, b"x", queue="q" * 256)


def test_batch_queue_is_checked(farm: Farm) -> None:
    with pytest.raises(ConfigurationError, match="queue is 256 characters"):
        farm.publish_batch(CONN, [b"x"], queue="q" * 256)
    with pytest.raises(ConfigurationError, match="queue must be a non-empty string"):
        farm.publish_batch(CONN, [b"x"], queue="")


def test_bad_timer_id_is_refused(farm: Farm) -> None:
    with pytest.raises(ConfigurationError, match="timer_id must be a non-empty string"):
        farm.publish(CONN, b"x", queue="q", timer_id="")
    with pytest.raises(ConfigurationError, match="timer_id is 256 characters"):
        farm.publish(CONN, b"x", queue="q", timer_id="t" * 256)


def test_cancel_timer_arguments_are_checked(farm: Farm) -> None:
    with pytest.raises(ConfigurationError, match="queue must be a non-empty string"):
        farm.cancel_timer(CONN, queue="", timer_id="t")
    with pytest.raises(ConfigurationError, match="timer_id must be a non-empty string"):
        farm.cancel_timer(CONN, queue="q", timer_id="")


def test_bad_correlation_id_is_refused(farm: Farm) -> None:
    with pytest.raises(ConfigurationError, match="correlation_id must be a non-empty string"):
        farm.publish(CONN, b"x", queue="q", correlation_id="")


# --- timing ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "activate_in",
    [-1, -0.001, timedelta(seconds=-1), math.nan, math.inf, -math.inf],
    ids=["-1", "-1ms", "negative-timedelta", "nan", "inf", "-inf"],
)
def test_activate_in_must_be_finite_and_non_negative(farm: Farm, activate_in: Any) -> None:
    with pytest.raises(ConfigurationError, match="activate_in must be finite and >= 0"):
        farm.publish(CONN, b"x", queue="q", activate_in=activate_in)


@pytest.mark.parametrize("activate_in", [True, False, "5", [1]])
def test_activate_in_must_be_a_number_or_timedelta(farm: Farm, activate_in: Any) -> None:
    with pytest.raises(ConfigurationError, match="activate_in must be seconds or a timedelta"):
        farm.publish(CONN, b"x", queue="q", activate_in=activate_in)


def test_activate_in_and_activate_at_together_are_refused(farm: Farm) -> None:
    with pytest.raises(ConfigurationError, match="activate_in or activate_at, not both"):
        farm.publish(CONN, b"x", queue="q", activate_in=5, activate_at=datetime.now(UTC))


def test_naive_activate_at_is_refused(farm: Farm) -> None:
    with pytest.raises(ConfigurationError, match="timezone-aware"):
        farm.publish(CONN, b"x", queue="q", activate_at=datetime(2030, 1, 1))


@pytest.mark.parametrize("activate_at", ["2030-01-01T00:00:00Z", date(2030, 1, 1), 0])
def test_activate_at_must_be_a_datetime(farm: Farm, activate_at: Any) -> None:
    with pytest.raises(ConfigurationError, match="activate_at must be a datetime"):
        farm.publish(CONN, b"x", queue="q", activate_at=activate_at)


def test_batch_timing_is_checked(farm: Farm) -> None:
    with pytest.raises(ConfigurationError, match="activate_in must be finite"):
        farm.publish_batch(CONN, [b"x"], queue="q", activate_in=math.nan)
    with pytest.raises(ConfigurationError, match="timezone-aware"):
        farm.publish_batch(CONN, [b"x"], queue="q", activate_at=datetime(2030, 1, 1))


# --- timers, headers, bodies ----------------------------------------------------------------


@pytest.mark.parametrize("policy", ["replace", "", None, "IGNORE"])
def test_bad_on_timer_conflict_is_refused(farm: Farm, policy: Any) -> None:
    with pytest.raises(ConfigurationError, match="on_timer_conflict must be 'ignore' or 'extend'"):
        farm.publish(CONN, b"x", queue="q", timer_id="t", on_timer_conflict=policy)


def test_bad_on_timer_conflict_is_refused_without_timer_id(farm: Farm) -> None:
    with pytest.raises(ConfigurationError, match="on_timer_conflict"):
        farm.publish(CONN, b"x", queue="q", on_timer_conflict="later")  # type: ignore[arg-type]


@pytest.mark.parametrize("headers", [[("a", "b")], "a=b", 3])
def test_headers_must_be_a_mapping(farm: Farm, headers: Any) -> None:
    with pytest.raises(ConfigurationError, match="headers must be a mapping"):
        farm.publish(CONN, b"x", queue="q", headers=headers)


@pytest.mark.parametrize("headers", [{"when": object()}, {1: "non-str key"}, {"s": {1, 2}}])
def test_headers_must_be_json_serialisable(farm: Farm, headers: Any) -> None:
    with pytest.raises(ConfigurationError, match="headers cannot be encoded as JSON"):
        farm.publish(CONN, b"x", queue="q", headers=headers)


@pytest.mark.parametrize("body", [object(), {1, 2}, {"n": 2**70}, {"f": lambda: None}])
def test_body_must_be_json_serialisable(farm: Farm, body: Any) -> None:
    with pytest.raises(ConfigurationError, match="body cannot be encoded as JSON"):
        farm.publish(CONN, body, queue="q")


def test_batch_body_must_be_json_serialisable(farm: Farm) -> None:
    with pytest.raises(ConfigurationError, match="body cannot be encoded as JSON"):
        farm.publish_batch(CONN, [b"fine", object()], queue="q")


def test_batch_headers_are_checked(farm: Farm) -> None:
    with pytest.raises(ConfigurationError, match="headers must be a mapping"):
        farm.publish_batch(CONN, [b"x"], queue="q", headers=["nope"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bodies",
    ["abc", b"abc", {"a": 1}, {b"a"}, (b for b in [b"x"])],
    ids=["str", "bytes", "dict", "set", "generator"],
)
def test_publish_batch_needs_a_sequence(farm: Farm, bodies: Any) -> None:
    with pytest.raises(ConfigurationError, match="takes a sequence"):
        farm.publish_batch(CONN, bodies, queue="q")


def test_empty_batch_sends_nothing(farm: Farm) -> None:
    assert farm.publish_batch(CONN, [], queue="q") == []
    assert farm.publish_batch(CONN, (), queue="q") == []


def test_empty_str_batch_is_refused_like_a_non_empty_one(farm: Farm) -> None:
    with pytest.raises(ConfigurationError, match="takes a sequence"):
        farm.publish_batch(CONN, "", queue="q")


def test_empty_batch_queue_is_still_validated(farm: Farm) -> None:
    with pytest.raises(ConfigurationError, match="queue must be a non-empty string"):
        farm.publish_batch(CONN, [], queue="")


# --- async variants validate the same way ---------------------------------------------------


def test_async_calls_validate_before_sql(farm: Farm) -> None:
    async def scenario() -> None:
        with pytest.raises(ConfigurationError, match="queue must be a non-empty string"):
            await farm.apublish(ACONN, b"x", queue="")
        with pytest.raises(ConfigurationError, match="not both"):
            await farm.apublish(
                ACONN, b"x", queue="q", activate_in=1, activate_at=datetime.now(UTC)
            )
        with pytest.raises(ConfigurationError, match="takes a sequence"):
            await farm.apublish_batch(ACONN, "abc", queue="q")
        with pytest.raises(ConfigurationError, match="timer_id must be a non-empty string"):
            await farm.acancel_timer(ACONN, queue="q", timer_id="")
        with pytest.raises(AssertionError, match="SQL was sent"):
            await farm.apublish(ACONN, b"x", queue="q")

    asyncio.run(scenario())


# --- body encoding --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [b"\x00\xffraw", bytearray(b"\x00\xffraw"), memoryview(b"\x00\xffraw")],
    ids=["bytes", "bytearray", "memoryview"],
)
def test_bytes_are_kept_as_they_are(body: Any) -> None:
    payload, content_type = encode_body(body)
    assert payload == b"\x00\xffraw"
    assert type(payload) is bytes
    assert content_type == "application/octet-stream"


def test_str_is_utf8() -> None:
    payload, content_type = encode_body("héllo ✓")
    assert payload == "héllo ✓".encode()
    assert content_type == "text/plain; charset=utf-8"


@pytest.mark.parametrize("body", [{"order": 7, "items": ["a", "é"]}, [1, 2], 3, None, True])
def test_other_bodies_are_json(body: Any) -> None:
    payload, content_type = encode_body(body)
    assert content_type == "application/json"
    assert orjson.loads(payload) == body


def test_content_type_header_follows_the_body() -> None:
    for body, expected in [
        (b"raw", "application/octet-stream"),
        ("text", "text/plain; charset=utf-8"),
        ({"a": 1}, "application/json"),
    ]:
        _, content_type = encode_body(body)
        headers = orjson.loads(encode_headers(None, None, content_type))
        assert headers["content-type"] == expected


def test_headers_merge_and_correlation_id() -> None:
    headers = orjson.loads(encode_headers({"tenant": "acme"}, "corr-1", "application/json"))
    assert headers == {
        "content-type": "application/json",
        "tenant": "acme",
        "correlation_id": "corr-1",
    }


def test_correlation_id_is_generated_and_unique() -> None:
    first = orjson.loads(encode_headers(None, None, "application/json"))["correlation_id"]
    second = orjson.loads(encode_headers(None, None, "application/json"))["correlation_id"]
    assert isinstance(first, str)
    assert len(first) == 32
    assert first != second


def test_correlation_id_from_headers_is_kept() -> None:
    headers = orjson.loads(encode_headers({"correlation_id": "from-h"}, None, "text/plain"))
    assert headers["correlation_id"] == "from-h"


# --- NUL characters: Postgres text and jsonb cannot hold them -------------------------------


@pytest.mark.parametrize(
    ("headers", "where"),
    [
        ({"tenant": "ac\x00me"}, "headers['tenant']"),
        ({"ten\x00ant": "acme"}, "the key headers['ten\\x00ant']"),
        ({"trace": {"ids": ["a", "b\x00"]}}, "headers['trace']['ids'][1]"),
    ],
    ids=["value", "key", "nested"],
)
def test_nul_in_headers_is_refused_before_sql(farm: Farm, headers: Any, where: str) -> None:
    expected = f"{where} contains a NUL character"
    with pytest.raises(ConfigurationError, match=re.escape(expected)):
        farm.publish(CONN, b"x", queue="q", headers=headers)
    with pytest.raises(ConfigurationError, match="NUL character"):
        farm.publish_batch(CONN, [b"x", b"y"], queue="q", headers=headers)

    async def scenario() -> None:
        with pytest.raises(ConfigurationError, match="NUL character"):
            await farm.apublish(ACONN, b"x", queue="q", headers=headers)
        with pytest.raises(ConfigurationError, match="NUL character"):
            await farm.apublish_batch(ACONN, [b"x"], queue="q", headers=headers)

    asyncio.run(scenario())


def test_nul_in_correlation_id_queue_and_timer_id_is_refused(farm: Farm) -> None:
    with pytest.raises(ConfigurationError, match="correlation_id contains a NUL character"):
        farm.publish(CONN, b"x", queue="q", correlation_id="c\x00")
    with pytest.raises(ConfigurationError, match="queue contains a NUL character"):
        farm.publish(CONN, b"x", queue="q\x00")
    with pytest.raises(ConfigurationError, match="timer_id contains a NUL character"):
        farm.publish(CONN, b"x", queue="q", timer_id="t\x00")


def test_an_escaped_backslash_u0000_is_not_a_nul() -> None:
    headers = orjson.loads(encode_headers({"path": "C:\\u0000"}, None, "text/plain"))
    assert headers["path"] == "C:\\u0000"


def test_nul_in_a_bytes_body_is_fine(farm: Farm) -> None:
    with pytest.raises(AssertionError, match="SQL was sent"):
        farm.publish(CONN, b"\x00", queue="q", headers={"ok": "yes"})
