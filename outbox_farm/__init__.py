"""outbox_farm: a transactional-outbox worker farm for PostgreSQL.

Publish in your own transaction with `Farm.publish`; deliver every committed row, at least
once, to handlers registered with `@farm.handler`, run by `outbox-farm start` or embedded with
`async with farm.running(dsn)`.
"""

from .errors import (
    ConfigurationError,
    DatabaseError,
    DeadLetter,
    IdentifierError,
    MigrationError,
    OutboxFarmError,
    Retry,
    SchemaError,
)
from .farm import Farm
from .handler import AckPolicy
from .message import Message
from .middleware import CallNext, Middleware
from .outcome import Kind, Outcome, Reason
from .retry import ConstantBackoff, ExponentialBackoff, LinearBackoff, NoRetry, RetryStrategy
from .schema_check import check_schema

__all__ = [
    "AckPolicy",
    "CallNext",
    "ConfigurationError",
    "ConstantBackoff",
    "DatabaseError",
    "DeadLetter",
    "ExponentialBackoff",
    "Farm",
    "IdentifierError",
    "Kind",
    "LinearBackoff",
    "Message",
    "Middleware",
    "MigrationError",
    "NoRetry",
    "OutboxFarmError",
    "Outcome",
    "Reason",
    "Retry",
    "RetryStrategy",
    "SchemaError",
    "check_schema",
]
