"""`dsn.scrub`: no fragment of a DSN's or broker URL's secret survives in a message, whatever
libpq or a client library quoted around it; everything else of the message stays readable."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from outbox_farm import dsn as dsn_module
from outbox_farm.cli.log_setup import JsonFormatter, TextFormatter
from outbox_farm.dsn import (
    MASK,
    check_dsn,
    redact,
    redact_url,
    remember,
    scrub,
    secret_fragments,
)
from outbox_farm.errors import ConfigurationError

FRAGMENTS = ("Sup3r", "S3cretPW", "ssS3cretPW")


@pytest.fixture(autouse=True)
def _forget() -> Iterator[None]:
    """Each test starts, and leaves the process, with no remembered secret."""
    saved = set(dsn_module._remembered)
    dsn_module._remembered.clear()
    yield
    dsn_module._remembered.clear()
    dsn_module._remembered.update(saved)


def libpq_says(dsn: str) -> str:
    """What libpq answers when asked to parse `dsn` (empty when it parses)."""
    try:
        conninfo_to_dict(dsn)
    except psycopg.Error as exc:
        return str(exc)
    return ""


def shows_none(text: str, *fragments: str) -> None:
    for fragment in fragments or FRAGMENTS:
        assert fragment not in text, text


# -- the three inputs of the issue, with libpq's own words -------------------------------------


def test_a_bad_percent_escape_quoted_by_libpq_is_masked() -> None:
    dsn = "postgresql://u:Sup3r%S3cretPW@127.0.0.1/db"
    said = libpq_says(dsn)
    assert "Sup3r%S3cretPW" in said  # the leak this guards against
    shown = scrub(f"invalid DSN {redact(dsn)!r}: {said}", dsn)
    shows_none(shown)
    assert 'invalid percent-encoded token: "***"' in shown
    assert "postgresql://u:***@127.0.0.1/db" in shown


def test_an_unquoted_password_with_a_blank_quoted_by_libpq_is_masked() -> None:
    dsn = "host=127.0.0.1 password=Sup3r S3cretPW dbname=x"
    said = libpq_says(dsn)
    assert "S3cretPW" in said
    shown = scrub(f"invalid DSN {redact(dsn)!r}: {said}", dsn)
    shows_none(shown)
    assert 'missing "=" after "***"' in shown
    assert "host=127.0.0.1" in shown
    assert "dbname=x" in shown


def test_a_password_holding_an_at_sign_is_masked_in_the_host_libpq_reports() -> None:
    dsn = "postgresql://u:p@ssS3cretPW@127.0.0.1/db"
    assert conninfo_to_dict(dsn)["host"] == "ssS3cretPW@127.0.0.1"  # libpq's reading
    shown = scrub(
        f"cannot connect to {redact(dsn)}: failed to resolve host 'ssS3cretPW@127.0.0.1'", dsn
    )
    shows_none(shown)
    assert "***@127.0.0.1" in shown
    assert "user=u" in shown


def test_check_dsn_refuses_without_quoting_the_secret() -> None:
    for dsn in ("postgresql://u:Sup3r%S3cretPW@127.0.0.1/db", "password=Sup3r S3cretPW host=h"):
        with pytest.raises(ConfigurationError) as caught:
            check_dsn(dsn)
        shows_none(str(caught.value))
        assert str(caught.value).startswith("invalid DSN")


# -- shapes of DSN -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "secret", "kept"),
    [
        ("postgresql://u:S3cretPW@db.example:5432/app", "S3cretPW", "db.example:5432/app"),
        ("postgresql://u:S3cretPW@db.example/app", "S3cretPW", "db.example/app"),
        ("postgres://u:S3cretPW@[::1]:5433/app", "S3cretPW", "[::1]:5433/app"),
        ("postgresql://u:S3cret%40PW@h/app", "S3cret@PW", "h/app"),
        ("postgresql://u:S3cret%40PW@h/app", "S3cret%40PW", "h/app"),
        ("postgresql://u:S3cretPW@h1:5432,h2:5433/app", "S3cretPW", "h1:5432,h2:5433/app"),
        ("postgresql://u@h/app?password=S3cretPW&sslmode=require", "S3cretPW", "sslmode=require"),
        ("postgresql://u@h/app?sslpassword=K3yPhrase", "K3yPhrase", "u@h/app"),
        ("postgresql://u:pa?ssS3cretPW@h/app", "pa?ssS3cretPW", "h/app"),
        ("postgresql://u:S3cret@PW@h/app?application_name=me@there", "S3cret@PW", "me@there"),
        ("host=h password=S3cretPW dbname=app", "S3cretPW", "dbname=app"),
        ("host=h password = S3cretPW dbname=app", "S3cretPW", "dbname=app"),
        ("host=h password='Sup3r S3cretPW' dbname=app", "Sup3r S3cretPW", "dbname=app"),
        ("host=h password='it\\'s S3cretPW' user=u", "it's S3cretPW", "user=u"),
        ("host=h password='back\\\\sl4sh' user=u", "back\\sl4sh", "user=u"),
        ("host=h password='unterminated S3cretPW", "unterminated S3cretPW", "host=h"),
        ("host=h1,h2 port=1,2 password=S3cretPW", "S3cretPW", "host=h1,h2 port=1,2"),
        ("host=h PASSWORD=S3cretPW", "S3cretPW", "host=h"),
    ],
)
def test_every_shape_of_secret_is_masked_and_the_rest_kept(
    source: str, secret: str, kept: str
) -> None:
    message = f"could not use {source}: the server said {secret!r} was wrong"
    shown = scrub(message, source)
    assert secret not in shown
    for piece in secret.replace("'", " ").split():
        if len(piece) >= 4:
            assert piece not in shown, shown
    assert kept in shown
    assert MASK in shown


def test_each_blank_separated_token_of_a_password_is_masked_alone() -> None:
    dsn = "host=h password=Sup3r S3cretPW dbname=x"
    assert scrub('missing "=" after "S3cretPW"', dsn) == 'missing "=" after "***"'
    assert scrub("token Sup3r here", dsn) == "token *** here"


def test_short_pieces_are_masked_only_where_they_stand_alone() -> None:
    dsn = "postgresql://u:p@ssS3cretPW@h/db"
    assert "p" in secret_fragments(dsn)
    assert scrub("password authentication failed for p", dsn) == (
        "password authentication failed for ***"
    )


def test_a_user_and_a_passfile_are_not_secrets() -> None:
    dsn = "postgresql://alice@h/db?passfile=/home/alice/.pgpass"
    assert secret_fragments(dsn) == []
    message = 'password authentication failed for user "alice"; password from /home/alice/.pgpass'
    assert scrub(message, dsn) == message
    assert secret_fragments("host=h user=alice passfile=/run/pgpass") == []


def test_a_dsn_without_a_secret_leaves_the_message_alone() -> None:
    message = "connection to server at 127.0.0.1, port 1 failed: Connection refused"
    assert scrub(message, "host=127.0.0.1 port=1 dbname=x") == message
    assert MASK not in redact("host=127.0.0.1 port=1 dbname=x")


# -- redact, and broker URLs ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://u:Sup3r%S3cretPW@127.0.0.1/db",
        "host=127.0.0.1 password=Sup3r S3cretPW dbname=x",
        "postgresql://u:p@ssS3cretPW@127.0.0.1/db",
        "host=127.0.0.1 password='Sup3r S3cretPW' dbname=x",
    ],
)
def test_redact_shows_no_fragment(dsn: str) -> None:
    shows_none(redact(dsn))
    assert "127.0.0.1" in redact(dsn)


@pytest.mark.parametrize(
    ("url", "kept"),
    [
        ("amqp://guest:Sup3r%S3cretPW@127.0.0.1:5672/", "amqp://guest:***@127.0.0.1:5672/"),
        ("amqp://guest:p@ssS3cretPW@127.0.0.1:5672/vh", "amqp://guest:***@127.0.0.1:5672/vh"),
        ("nats://u:Sup3r S3cretPW@127.0.0.1:4222", "nats://u:***@127.0.0.1:4222"),
        ("nats://S3cretPWtoken@127.0.0.1:4222", "nats://***@127.0.0.1:4222"),
        ("redis://:p@ssS3cretPW@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        ("rediss://default:Sup3r%S3cretPW@cache:6380/1", "rediss://default:***@cache:6380/1"),
    ],
)
def test_broker_urls_are_redacted_past_the_last_at_sign(url: str, kept: str) -> None:
    assert redact_url(url) == kept
    secret = url.split("://")[1].rsplit("@", 1)[0].split(":")[-1]
    said = f"{redact_url(url)}: Error('bad userinfo {secret}, host {url.split('@', 1)[1]}')"
    shows_none(scrub(said, url), *(f for f in (*FRAGMENTS, "S3cretPWtoken") if f in url))


def test_a_postgres_user_without_password_is_no_token() -> None:
    assert redact_url("postgresql://alice@h/db") == "postgresql://alice@h/db"


# -- remembered secrets: every log line ----------------------------------------------------------


def test_remembered_secrets_are_masked_in_every_log_line() -> None:
    remember("postgresql://u:p@ssS3cretPW@127.0.0.1/db")
    record = logging.LogRecord(
        "psycopg.pool",
        logging.WARNING,
        __file__,
        1,
        "error connecting: host %r",
        ("ssS3cretPW",),
        None,
    )
    record.detail = "ssS3cretPW@127.0.0.1"
    text = TextFormatter().format(record)
    json = JsonFormatter().format(record)
    shows_none(text)
    shows_none(json)
    assert "error connecting: host '***'" in text
    assert '"detail":"***@127.0.0.1"' in json


def test_scrub_without_sources_masks_only_what_was_remembered() -> None:
    assert scrub("S3cretPW") == "S3cretPW"
    remember("host=h password=S3cretPW")
    assert scrub("S3cretPW") == MASK
