"""Which failures to start a worker's runtime are an outage to wait out, and which are boot
failures that count toward the farm giving up (`child.unreachable`).

An unreachable database (refused, timed out, starting up, shutting down) passes by itself: a
worker waits for it. A wrong DSN syntax, a missing table or privilege, an app or settings
error do not: retrying only fails the same way.
"""

from __future__ import annotations

import asyncio

import psycopg
import psycopg.errors
import pytest

from outbox_farm.db.pool import probe
from outbox_farm.errors import (
    ConfigurationError,
    ConnectionLost,
    PrivilegeError,
    SchemaError,
)
from outbox_farm.prefork.child import unreachable
from outbox_farm.prefork.restarts import MAX_DELAY, QUICK_CRASH, RestartBackoff

DSN = "host=127.0.0.1 port=1 user=postgres password=Sup3rS3cretPW dbname=nothing"


def probe_error(dsn: str) -> ConfigurationError:
    """What the runtime's first connection raises for `dsn`."""
    with pytest.raises(ConfigurationError) as caught:
        asyncio.run(probe(dsn, timeout=5))
    return caught.value


def raised_during(driver: BaseException, error: Exception) -> Exception:
    """`error` as raised while `driver` was being handled (its `__context__`)."""
    try:
        try:
            raise driver
        except BaseException:
            raise error from None
    except Exception as exc:
        return exc


def test_a_refused_connection_is_an_outage_and_its_reason_shows_no_secret() -> None:
    reason = unreachable(probe_error(DSN), DSN)
    assert reason is not None
    assert "Connection refused" in reason
    assert "Sup3rS3cretPW" not in reason
    assert "\n" not in reason


@pytest.mark.parametrize(
    "driver",
    [
        psycopg.OperationalError("connection failed: timeout expired"),  # no SQLSTATE
        psycopg.errors.CannotConnectNow("the database system is starting up"),  # 57P03
        psycopg.errors.AdminShutdown("terminating connection due to administrator command"),
        psycopg.errors.CrashShutdown("terminating connection due to crash of another server"),
        psycopg.errors.ConnectionFailure("connection failure"),  # class 08
        psycopg.errors.TooManyConnections("sorry, too many clients already"),
    ],
    ids=["timeout", "starting-up", "admin-shutdown", "crash-shutdown", "class-08", "full"],
)
def test_connection_failures_while_probing_are_outages(driver: Exception) -> None:
    error = raised_during(driver, ConfigurationError(f"cannot connect to x: {driver}"))
    assert unreachable(error, DSN) is not None


def test_a_connection_lost_while_opening_the_pool_is_an_outage() -> None:
    assert unreachable(ConnectionLost("couldn't get a connection after 30.00 sec"), DSN)


@pytest.mark.parametrize(
    "error",
    [
        ConfigurationError("the farm has no handlers: register one with @farm.handler"),
        raised_during(
            psycopg.ProgrammingError("invalid connection option"),
            ConfigurationError("invalid DSN 'x': invalid connection option"),
        ),
        raised_during(
            psycopg.errors.InvalidPassword("password authentication failed"),  # 28P01
            ConfigurationError("cannot connect to x: password authentication failed"),
        ),
        SchemaError("outbox table outbox does not exist: run `outbox-farm migrate`"),
        PrivilegeError("permission denied for table outbox"),
        TypeError("a bug"),
    ],
    ids=["no-handlers", "bad-dsn-syntax", "sqlstate-28P01", "schema", "privilege", "bug"],
)
def test_failures_that_retrying_does_not_fix_are_boot_failures(error: Exception) -> None:
    assert unreachable(error, DSN) is None


def test_restart_backoff_works_on_monotonic_readings_near_zero() -> None:
    """Monotonic time starts near zero at boot: a first crash then is no quick crash."""
    backoff = RestartBackoff()
    assert backoff.crashed(slot=0, now=0.2) == 0.0
    assert backoff.may_spawn(0, 0.2)
    delay = backoff.crashed(slot=0, now=0.2 + QUICK_CRASH / 2)
    assert 0 < delay <= MAX_DELAY
    assert not backoff.may_spawn(0, 0.2 + QUICK_CRASH / 2)
    assert backoff.may_spawn(0, 0.2 + QUICK_CRASH / 2 + delay)
    assert backoff.may_spawn(1, 0.2 + QUICK_CRASH / 2)  # other slots are not held back
