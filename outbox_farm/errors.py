"""Every error outbox_farm raises, and the two exceptions handlers raise to steer a row.

psycopg errors are translated to these at exactly one boundary per component (the producer,
the migrator, the schema check; for the runtime, `outbox_farm.db`), so callers catch one family
and decide from its classes alone: `ConnectionLost` passes by reconnecting, `PermanentError`
needs an operator, any other `DatabaseError` was one statement refused. Each class's docstring
is its default message.
"""

from __future__ import annotations

import psycopg


class OutboxFarmError(Exception):
    """outbox_farm failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class ConfigurationError(OutboxFarmError, ValueError):
    """The farm, a handler or a publish call was configured wrongly."""


class IdentifierError(ConfigurationError):
    """A table name, or a name derived from it, is not a usable Postgres identifier."""


class DatabaseError(OutboxFarmError, psycopg.Error):
    """The database refused an outbox_farm statement.

    Also a `psycopg.Error`, so code that already catches the driver's errors keeps working.
    `sqlstate` is the server's SQLSTATE when the server refused it, else None.
    """


class ConnectionLost(DatabaseError):
    """The database could not be reached, or the connection broke; retrying may succeed.

    A statement in flight when the connection broke may or may not have committed.
    """


class PermanentError(DatabaseError):
    """The database refused an outbox_farm statement in a way retrying does not change.

    A missing table, column or privilege: it lasts until an operator migrates or grants.
    """


class SchemaError(PermanentError):
    """The database schema does not match what outbox_farm needs; run `outbox-farm check`."""


class PrivilegeError(PermanentError):
    """This role lacks a privilege outbox_farm needs; `outbox-farm check` names the GRANT."""


class MigrationError(DatabaseError):
    """A migration could not be applied; nothing of it was committed."""


class AppImportError(OutboxFarmError):
    """The application path could not be imported as `module:attribute`."""


class Retry(Exception):
    """Raised by a handler: try this message again after `delay` seconds (strategy if None)."""

    def __init__(self, delay: float | None = None, reason: str = "") -> None:
        super().__init__(reason or f"retry requested (delay={delay})")
        self.delay = delay


class DownstreamDown(Exception):
    """Raised by a handler: what it calls is down, not this message at fault. With a `Breaker`
    on the queue, it opens the breaker at once (the queue holds, probing, its rows' attempts
    kept); without one, it is a failure like any other."""


class DeadLetter(Exception):
    """Raised by a handler: give up on this message now (DLQ reason `rejected`)."""

    def __init__(self, reason: str = "dead-lettered by handler") -> None:
        super().__init__(reason)
        self.reason = reason
