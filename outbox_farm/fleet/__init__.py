"""Many outboxes in one farm: several outbox tables, in many databases, shared out across the
farm's processes and hosts by leases kept in one database (see `Fleet`)."""

from .fleet import Fleet

__all__ = ["Fleet"]
