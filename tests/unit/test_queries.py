"""The named SQL blocks: all present, composed with the table identifiers, DLQ ones guarded."""

from __future__ import annotations

import pytest

from outbox_farm.names import TableNames
from outbox_farm.queries import Queries, load_blocks

EXPECTED = [
    "claim",
    "next_due",
    "ack",
    "retry",
    "release",
    "dlq_move",
    "publish",
    "publish_timer",
    "publish_extend",
    "publish_batch",
    "cancel_timer",
    "gauges",
    "dlq_gauges",
    "vacuum_state",
    "vacuum",
    "release_worker",
    "extend_leases",
    "lease_holders",
    "table_oid",
    "columns",
    "indexes",
    "checks",
]
NEEDS_DLQ = {"dlq_move", "dlq_gauges"}


def test_every_expected_block_is_defined() -> None:
    blocks = load_blocks()
    missing = [name for name in EXPECTED if name not in blocks]
    assert missing == []
    for name in EXPECTED:
        assert blocks[name].strip(), f"block {name} is empty"
        assert not blocks[name].startswith("-- name:")


@pytest.mark.parametrize("name", EXPECTED)
def test_every_block_composes_with_a_dlq(name: str) -> None:
    queries = Queries(TableNames.build("outbox", "outbox_dlq"))
    text = queries[name]
    for placeholder in ("{outbox}", "{dlq}", "{pending_idx}", "{lease_idx}", "{timer_idx}"):
        assert placeholder not in text


def test_table_names_are_composed_as_quoted_identifiers() -> None:
    queries = Queries(TableNames.build("app.jobs", "app.jobs_dlq"))
    assert '"app"."jobs"' in queries["claim"]
    assert '"app"."jobs"' in queries["publish"]
    dlq_move = queries["dlq_move"]
    assert '"app"."jobs"' in dlq_move
    assert '"app"."jobs_dlq"' in dlq_move


@pytest.mark.parametrize("name", sorted(NEEDS_DLQ))
def test_queries_without_dlq_refuse_dlq_blocks(name: str) -> None:
    queries = Queries(TableNames.build("outbox", None))
    with pytest.raises(KeyError, match="needs a DLQ table"):
        queries[name]


# These take the table name as a parameter.
CATALOG_BLOCKS = {"table_oid", "columns", "indexes", "checks", "vacuum_state"}


def test_queries_without_dlq_still_have_every_other_block() -> None:
    queries = Queries(TableNames.build("outbox", None))
    for name in EXPECTED:
        if name in NEEDS_DLQ:
            continue
        text = queries[name]
        if name not in CATALOG_BLOCKS:
            assert '"outbox"' in text, name


def test_unknown_block_is_a_plain_key_error() -> None:
    queries = Queries(TableNames.build("outbox", "outbox_dlq"))
    with pytest.raises(KeyError) as info:
        queries["no_such_block"]
    assert "DLQ" not in str(info.value)
