"""The named SQL blocks: all present, composed with the table identifiers, DLQ ones guarded."""

from __future__ import annotations

import pytest

from outbox_farm.db.claims import unranked
from outbox_farm.db.operator import OUTBOX_CONDITIONS, AdminSql
from outbox_farm.names import TableNames
from outbox_farm.queries import Queries, compose, load_blocks

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


def test_a_block_composed_by_its_own_module_says_so_rather_than_asking_for_a_dlq() -> None:
    queries = Queries(TableNames.build("outbox", "outbox_dlq"))
    with pytest.raises(KeyError, match=r"\{channel\}, which is not a table name") as info:
        queries["listen"]
    assert "DLQ" not in str(info.value)


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


# The schema tools' blocks: no table placeholders (the migration records, catalog reads) or
# identifiers filled in when a GRANT is printed.
SCHEMA_BLOCKS = [
    "migrations_table",
    "migration_applied",
    "migration_record",
    "migrate_lock",
    "migrate_unlock",
    "migration_forget",
    "table_privileges",
    "grant_table",
    "grant_schema",
    "grant_sequence",
]

# The operator tools' statements, with the blocks and tables AdminSql fills in.
OPERATOR_STATEMENTS: list[tuple[str, dict[str, str]]] = [
    ("admin_dlq_list", {"match": "admin_dlq_match"}),
    ("admin_dlq_show", {}),
    ("admin_dlq_summary", {"match": "admin_dlq_match"}),
    ("admin_dlq_replay", {"match": "admin_dlq_match"}),
    ("admin_dlq_purge", {"match": "admin_dlq_match"}),
    ("outbox_queues", {}),
    ("dlq_queues", {}),
    ("admin_dlq_newest", {}),
    ("admin_oldest_ready", {}),
    ("admin_server", {}),
    ("admin_table_health", {}),
    ("admin_xmin_holder", {}),
    *[
        ("admin_explain", {"statement": "admin_count", "table": "outbox", "condition": condition})
        for condition in OUTBOX_CONDITIONS.values()
    ],
    *[
        ("admin_count", {"table": "outbox", "condition": condition})
        for condition in OUTBOX_CONDITIONS.values()
    ],
    ("admin_explain", {"statement": "admin_count", "table": "dlq", "condition": "admin_is_dead"}),
]


def test_every_schema_block_is_defined() -> None:
    blocks = load_blocks()
    assert [name for name in SCHEMA_BLOCKS if not blocks.get(name, "").strip()] == []


@pytest.mark.parametrize(("block", "parts"), OPERATOR_STATEMENTS)
def test_every_operator_statement_is_composed_whole(block: str, parts: dict[str, str]) -> None:
    text = AdminSql(TableNames.build("app.jobs", "app.jobs_dlq")).render(block, **parts)
    assert "{" not in text.replace("'{}'", ""), text  # only the empty array/object literals
    assert "-- name:" not in text


def test_compose_quotes_the_table_names() -> None:
    names = TableNames.build("app.Jobs", "app.jobs_dlq")
    assert compose("SELECT 1 FROM {outbox}, {dlq}", names) == (
        'SELECT 1 FROM "app"."Jobs", "app"."jobs_dlq"'
    )
    with pytest.raises(KeyError):
        compose("SELECT 1 FROM {dlq}", TableNames.build("jobs"))


def test_every_statement_stays_within_the_drivers_parse_cache() -> None:
    """psycopg parses a statement's placeholders once and caches the result only for texts up
    to MAX_CACHED_STATEMENT_LENGTH; a longer one (the claim, with its explanation, was 6.7 KB)
    is parsed again on every execute, a cost paid per claim. Even with the longest names the
    identifiers allow, every statement must fit."""
    from psycopg._queries import MAX_CACHED_STATEMENT_LENGTH

    longest = TableNames.build("s" * 63 + "." + "o" * 45, "d" * 45)
    queries = Queries(longest)
    sizes = {name: len(queries[name].encode()) for name in queries._composed}
    # The claim with its ranking (sent only for a queue with rows above priority 0, see
    # `db.claims`) names the table nine times: it fits up to a table of 26 characters in a
    # schema; past that, only such a queue's claims pay the parse (tens of microseconds, beside
    # milliseconds of the claim's own).
    ranked = sizes.pop("claim")
    assert max(sizes.values()) <= MAX_CACHED_STATEMENT_LENGTH, sorted(
        sizes.items(), key=lambda item: -item[1]
    )[:3]
    assert len(unranked(queries).encode()) <= MAX_CACHED_STATEMENT_LENGTH
    assert ranked > MAX_CACHED_STATEMENT_LENGTH  # so the bound below is the one that matters
    usual = Queries(TableNames.build("app." + "o" * 26, "d" * 45))
    assert len(usual["claim"].encode()) <= MAX_CACHED_STATEMENT_LENGTH
