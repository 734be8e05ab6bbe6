"""Every error outbox_farm raises, and the two exceptions handlers raise to steer a row.

psycopg errors are translated to these at exactly one boundary per component (the producer,
the migrator, the schema check, the runtime's connection helpers), so callers catch one family.
Each class's docstring is its default message.
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
    """


class SchemaError(DatabaseError):
    """The database schema does not match what outbox_farm needs; run `outbox-farm check`."""


class MigrationError(DatabaseError):
    """A migration could not be applied; nothing of it was committed."""


class AppImportError(OutboxFarmError):
    """The application path could not be imported as `module:attribute`."""


class Retry(Exception):
    """Raised by a handler: try this message again after `delay` seconds (strategy if None)."""

    def __init__(self, delay: float | None = None, reason: str = "") -> None:
        super().__init__(reason or f"retry requested (delay={delay})")
        self.delay = delay


class DeadLetter(Exception):
    """Raised by a handler: give up on this message now (DLQ reason `rejected`)."""

    def __init__(self, reason: str = "dead-lettered by handler") -> None:
        super().__init__(reason)
        self.reason = reason
