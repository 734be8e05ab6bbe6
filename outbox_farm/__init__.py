"""outbox_farm: a transactional-outbox worker farm for PostgreSQL.

Publish in your own transaction with `Farm.publish`; deliver every committed row, at least
once, to handlers registered with `@farm.handler`, run by `outbox-farm start` or embedded with
`async with farm.running(dsn)`.
"""

from .breaker import Breaker
from .errors import (
    ConfigurationError,
    ConnectionLost,
    DatabaseError,
    DeadLetter,
    DownstreamDown,
    IdentifierError,
    MigrationError,
    OutboxFarmError,
    PermanentError,
    PrivilegeError,
    Retry,
    SchemaError,
)
from .farm import Farm
from .handler import AckPolicy
from .message import Message
from .middleware import CallNext, Middleware
from .names import TableNames
from .observe import Observer
from .ops.schema_check import check_schema
from .outcome import Kind, Outcome, Reason
from .retry import ConstantBackoff, ExponentialBackoff, LinearBackoff, NoRetry, RetryStrategy
from .settings import RuntimeSettings

# The version, in one place: the build reads it from here (pyproject.toml, [tool.hatch.version]).
__version__ = "0.1.0"

__all__ = [
    "AckPolicy",
    "Breaker",
    "CallNext",
    "ConfigurationError",
    "ConnectionLost",
    "ConstantBackoff",
    "DatabaseError",
    "DeadLetter",
    "DownstreamDown",
    "ExponentialBackoff",
    "Farm",
    "IdentifierError",
    "Kind",
    "LinearBackoff",
    "Message",
    "Middleware",
    "MigrationError",
    "NoRetry",
    "Observer",
    "OutboxFarmError",
    "Outcome",
    "PermanentError",
    "PrivilegeError",
    "Reason",
    "Retry",
    "RetryStrategy",
    "RuntimeSettings",
    "SchemaError",
    "TableNames",
    "check_schema",
]
