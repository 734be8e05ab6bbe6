"""Publishing with plain psycopg 3: the order and its event commit together, or neither does."""

from __future__ import annotations

from typing import Any

import psycopg

from outbox_farm import Farm

farm = Farm()


def place_order(conn: psycopg.Connection[Any], customer: str, total_cents: int) -> int:
    """Insert an order and publish `order_placed` in one transaction; return the order id."""
    with conn.transaction():
        row = conn.execute(
            "INSERT INTO orders (customer, total_cents) VALUES (%s, %s) RETURNING id",
            (customer, total_cents),
        ).fetchone()
        assert row is not None
        order_id = int(row[0])
        farm.publish(
            conn,
            {"order_id": order_id, "customer": customer, "total_cents": total_cents},
            queue="order_placed",
            ordering_key=f"order-{order_id}",
        )
    return order_id
