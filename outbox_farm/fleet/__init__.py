"""Many outboxes in one farm: several outbox tables, in many databases, shared out across the
farm's processes and hosts by leases kept in one database (see `Fleet`)."""
