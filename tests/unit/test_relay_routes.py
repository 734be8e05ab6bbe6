"""Routes of relay targets (pure: no broker, no database): a template that names only `{queue}`
is formatted once for a batch of one queue, and anything else still per row, with the row's own
fields and its own failure."""

from __future__ import annotations

import pytest

from outbox_farm.relay.base import BrokerReply, Delivery, Envelope, _per_queue, routed


def envelope(row_id: int, queue: str = "orders", **headers: str) -> Envelope:
    return Envelope(row_id, f"outbox:{row_id}:1", queue, b"{}", headers, None, None)


@pytest.mark.parametrize(
    ("template", "per_queue"),
    [
        ("orders", True),
        ("{queue}", True),
        ("out.{queue}.v1", True),
        ("{queue!r}", True),
        ("{queue:>8}", True),
        ("{{literal}}.{queue}", True),
        ("{queue:{row_id}}", False),  # a nested field in the format spec varies per row
        ("{queue.upper}", False),
        ("{row_id}", False),
        ("{headers[tenant]}", False),
        ("{queue}.{ordering_key}", False),
    ],
)
def test_only_a_template_of_the_queue_alone_is_formatted_once(
    template: str, per_queue: bool
) -> None:
    assert _per_queue(template) is per_queue


def test_a_queue_template_gives_every_row_its_queues_route() -> None:
    batch = [envelope(i) for i in range(5)]
    assert routed("events.{queue}", batch) == ["events.orders"] * 5
    assert routed("{queue:>8}", batch) == ["  orders"] * 5


def test_a_batch_of_several_queues_is_routed_row_by_row() -> None:
    batch = [envelope(1, "orders"), envelope(2, "refunds"), envelope(3, "orders")]
    assert routed("events.{queue}", batch) == ["events.orders", "events.refunds", "events.orders"]


def test_per_row_templates_still_use_each_rows_fields_and_fail_alone() -> None:
    batch = [envelope(1, tenant="acme"), envelope(2), envelope(3, tenant="initech")]
    got = routed("{queue}.{headers[tenant]}", batch)
    assert got[0] == "orders.acme"
    assert got[2] == "orders.initech"
    failed = got[1]
    assert isinstance(failed, Delivery)
    assert failed.outcome is BrokerReply.NACKED
    assert "tenant" in str(failed.reason)
    assert routed("{queue:{row_id}}", [envelope(7), envelope(10)]) == ["orders ", "orders    "]


def test_an_empty_batch_has_no_routes() -> None:
    assert routed("{queue}", []) == []
