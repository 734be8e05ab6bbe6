"""The one rule for what a replay or purge acts on (`admin.dlq.Selection`), shared by the CLI
and the console: IDs, a filter, or every row, never every row by accident."""

from __future__ import annotations

import pytest

from outbox_farm.admin import DlqFilter
from outbox_farm.admin.dlq import MAX_ID, Selection
from outbox_farm.errors import ConfigurationError


def test_ids_a_filter_or_every_row_asked_for_as_such() -> None:
    by_ids = Selection.of([3, 1, 3], DlqFilter(queue="q"), False, verb="purge")
    assert by_ids.where == DlqFilter(ids=(1, 3), queue="q")
    assert not by_ids.everything
    by_filter = Selection.of([], DlqFilter(reason="rejected"), False, verb="purge")
    assert by_filter.where == DlqFilter(reason="rejected")
    assert not by_filter.everything
    every = Selection.of([], DlqFilter(), True, verb="replay")
    assert every.everything
    with pytest.raises(ConfigurationError, match="say which rows to purge: IDs, a filter"):
        Selection.of([], DlqFilter(), False, verb="purge")
    with pytest.raises(ConfigurationError, match="give IDs or --all, not both"):
        Selection.of([1], DlqFilter(), True, verb="purge", every_is="--all")


def test_a_filter_the_operator_did_not_choose_selects_nothing() -> None:
    """The CLI's filter read from the environment narrows, but is no selection."""
    env_only = DlqFilter(queue="orders")
    with pytest.raises(ConfigurationError, match="--queue, --grep"):
        Selection.of(
            [], env_only, False, verb="replay", filtered=False, filters_are="--queue, --grep"
        )
    assert Selection.of([7], env_only, False, verb="replay", filtered=False).where.ids == (7,)


@pytest.mark.parametrize("bad", [0, -1, MAX_ID + 1])
def test_ids_are_bigints_above_zero(bad: int) -> None:
    with pytest.raises(ConfigurationError, match="is not a row id"):
        Selection.of([bad], DlqFilter(), False, verb="purge")


def test_an_unknown_reason_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="is not one of"):
        Selection.of([], DlqFilter(reason="rejectd"), False, verb="purge")


@pytest.mark.parametrize("field", ["queue", "reason", "grep", "cause"])
@pytest.mark.parametrize("text", ["", "  ", "\t\n"])
def test_an_empty_filter_is_refused_whichever_it_is(field: str, text: str) -> None:
    """An empty text is contained in every row: `--grep ""` from a script whose variable was
    unset selected the whole DLQ for a purge. Refused as a selection and in any operation."""
    where = DlqFilter(**{field: text})
    with pytest.raises(ConfigurationError, match=f"the {field} filter is empty"):
        Selection.of([], where, False, verb="purge")
    with pytest.raises(ConfigurationError, match=f"the {field} filter is empty"):
        where.match()
    assert Selection.of([], DlqFilter(**{field: "rejected"}), False, verb="purge").where == (
        DlqFilter(**{field: "rejected"})
    )
