"""Table names and the identifiers derived from them: refused up front, never truncated."""

from __future__ import annotations

import pytest

from outbox_farm.errors import ConfigurationError, IdentifierError
from outbox_farm.names import MAX_IDENTIFIER_BYTES, QualifiedName, TableNames

# Longest names whose every derived identifier still fits in 63 bytes:
# "<outbox>_pending_idx" / "<outbox>_timer_id_uq" (12-byte suffixes) and
# "<dlq>_queue_failed_idx" (17-byte suffix).
LONGEST_OUTBOX = MAX_IDENTIFIER_BYTES - len("_pending_idx")
LONGEST_DLQ = MAX_IDENTIFIER_BYTES - len("_queue_failed_idx")


def rendered(names: TableNames) -> dict[str, str]:
    return {key: ident.as_string(None) for key, ident in names.identifiers().items()}


def test_identifier_error_is_a_configuration_error() -> None:
    assert issubclass(IdentifierError, ConfigurationError)
    assert issubclass(IdentifierError, ValueError)


def test_default_names_and_derived_identifiers() -> None:
    names = TableNames.build("outbox", "outbox_dlq")
    assert names.channel == "outbox_outbox"
    assert rendered(names) == {
        "notify_channel": "'outbox_outbox'",
        "outbox": '"outbox"',
        "pending_idx": '"outbox_pending_idx"',
        "lease_idx": '"outbox_lease_idx"',
        "timer_idx": '"outbox_timer_id_uq"',
        "ordering_idx": '"outbox_order_idx"',
        "blocked_idx": '"outbox_blocked_idx"',
        "priority_idx": '"outbox_prio_idx"',
        "fair_idx": '"outbox_fair_idx"',
        "lease_ck": '"outbox_lease_ck"',
        "counts_ck": '"outbox_counts_ck"',
        "values_ck": '"outbox_values_ck"',
        "blocked_ck": '"outbox_blocked_ck"',
        "dlq": '"outbox_dlq"',
        "dlq_idx": '"outbox_dlq_queue_failed_idx"',
        "dlq_reason_idx": '"outbox_dlq_reason_idx"',
        "dlq_queue_reason_idx": '"outbox_dlq_queue_reason_idx"',
        "dlq_queue_reason_stats": '"outbox_dlq_reason_stats"',
        "dlq_cause_fn": '"outbox_dlq_cause"',
        "dlq_cause_idx": '"outbox_dlq_cause_idx"',
        "dlq_causes": '"outbox_dlq_causes"',
        "dlq_causes_count": '"outbox_dlq_causes_count"',
        "dlq_cause_fn_name": "'outbox_dlq_cause'",
        "dlq_causes_name": "'outbox_dlq_causes'",
        "dlq_causes_count_name": "'outbox_dlq_causes_count'",
    }


def test_no_dlq_has_no_dlq_identifiers() -> None:
    names = TableNames.build("outbox", None)
    assert names.dlq is None
    assert "dlq" not in names.identifiers()
    assert "dlq_idx" not in names.identifiers()


@pytest.mark.parametrize("table", ["", "app."])
def test_empty_table_name_is_refused(table: str) -> None:
    with pytest.raises(IdentifierError, match="table name is empty"):
        TableNames.build(table)


def test_empty_dlq_name_is_refused() -> None:
    with pytest.raises(IdentifierError, match="DLQ table name is empty"):
        TableNames.build("outbox", "")


def test_empty_schema_part_is_refused() -> None:
    with pytest.raises(IdentifierError, match="empty schema part"):
        TableNames.build(".outbox")


@pytest.mark.parametrize("table", ["out\x00box", "app\x00.outbox"])
def test_nul_byte_is_refused(table: str) -> None:
    with pytest.raises(IdentifierError, match="NUL byte"):
        TableNames.build(table)


def test_non_string_table_is_refused() -> None:
    with pytest.raises(IdentifierError, match="must be a string, not int"):
        TableNames.build(42)  # type: ignore[arg-type]


def test_table_name_over_63_bytes_is_refused() -> None:
    with pytest.raises(IdentifierError, match="is 64 bytes; Postgres keeps at most 63") as info:
        TableNames.build("t" * 64)
    assert "table name" in str(info.value)


def test_multibyte_name_is_measured_in_bytes_not_characters() -> None:
    name = "é" * 32  # 32 characters, 64 bytes of UTF-8
    assert len(name) < MAX_IDENTIFIER_BYTES
    with pytest.raises(IdentifierError, match="is 64 bytes"):
        TableNames.build(name)


def test_multibyte_derived_name_is_measured_in_bytes() -> None:
    name = "é" * 26  # 52 bytes: fits, but "<name>_pending_idx" is 64 bytes
    with pytest.raises(IdentifierError, match=r"pending index name .* is 64 bytes"):
        TableNames.build(name)


def test_longest_outbox_name_is_accepted_and_every_derived_name_fits() -> None:
    table = "o" * LONGEST_OUTBOX
    names = TableNames.build(table, "d" * LONGEST_DLQ)
    assert names.outbox.name == table
    for text in (*rendered(names).values(), f'"{names.channel}"'):
        assert len(text.strip('"').encode()) <= MAX_IDENTIFIER_BYTES, text


def test_derived_index_name_too_long_is_refused() -> None:
    table = "o" * (LONGEST_OUTBOX + 1)
    assert len(table) < MAX_IDENTIFIER_BYTES  # the table name itself would be fine
    with pytest.raises(IdentifierError) as info:
        TableNames.build(table)
    message = str(info.value)
    assert "pending index name" in message
    assert f"{table}_pending_idx" in message
    assert "Choose a shorter table name" in message


def test_derived_dlq_index_name_too_long_is_refused() -> None:
    dlq = "d" * (LONGEST_DLQ + 1)
    with pytest.raises(IdentifierError, match="DLQ index name") as info:
        TableNames.build("outbox", dlq)
    assert f"{dlq}_queue_failed_idx" in str(info.value)


def test_channel_name_is_checked_as_an_identifier() -> None:
    # The channel prefix is shorter than the index suffixes, so an index name always fails
    # first; what matters is that no accepted name has a channel Postgres would truncate.
    names = TableNames.build("o" * LONGEST_OUTBOX)
    assert names.channel == "outbox_" + "o" * LONGEST_OUTBOX
    assert len(names.channel.encode()) <= MAX_IDENTIFIER_BYTES


def test_schema_qualified_names() -> None:
    names = TableNames.build("app.jobs", "audit.jobs_dlq")
    assert names.outbox == QualifiedName("app", "jobs")
    assert str(names.outbox) == "app.jobs"
    assert names.dlq == QualifiedName("audit", "jobs_dlq")
    ids = rendered(names)
    assert ids["outbox"] == '"app"."jobs"'
    assert ids["dlq"] == '"audit"."jobs_dlq"'
    # Index and constraint names are never schema-qualified: Postgres puts an index in its
    # table's schema, and the length limit applies to the bare name.
    assert ids["pending_idx"] == '"jobs_pending_idx"'
    assert ids["dlq_idx"] == '"jobs_dlq_queue_failed_idx"'
    # The channel is the bare table name.
    assert names.channel == "outbox_jobs"


def test_schema_part_over_63_bytes_is_refused() -> None:
    with pytest.raises(IdentifierError, match=r"schema of table name .* is 64 bytes"):
        TableNames.build("s" * 64 + ".outbox")


def test_long_schema_does_not_count_against_derived_names() -> None:
    names = TableNames.build("s" * 63 + "." + "o" * LONGEST_OUTBOX)
    assert names.outbox.schema == "s" * 63


def test_identifiers_are_quoted_not_interpolated() -> None:
    names = TableNames.build('we"ird; DROP TABLE x')
    assert rendered(names)["outbox"] == '"we""ird; DROP TABLE x"'


@pytest.mark.parametrize(("table", "dlq"), [("outbox", "outbox"), ("app.jobs", "app.jobs")])
def test_dlq_equal_to_outbox_is_refused(table: str, dlq: str) -> None:
    with pytest.raises(IdentifierError, match="DLQ table must differ from the outbox table"):
        TableNames.build(table, dlq)


def test_same_bare_name_in_other_schema_is_a_different_table() -> None:
    names = TableNames.build("app.jobs", "dead.jobs")
    assert names.dlq is not None
    assert names.dlq != names.outbox
