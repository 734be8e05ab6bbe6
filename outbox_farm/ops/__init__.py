"""Schema and operations: the server a command works on (`server`, `embedded`), the
migrations and the checks of the schema and the role (`migrate`, `schema_check`, `privileges`,
`readiness`)."""
