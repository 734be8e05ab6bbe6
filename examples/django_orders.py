"""Publishing from Django (4.2+, the psycopg 3 backend).

Inside `transaction.atomic()`, `connection.connection` is the psycopg connection Django's own
queries run on, so the outbox row commits or rolls back with them. (With models, the same holds
for `Order.objects.create(...)` in place of the raw INSERT below.)
"""

from __future__ import annotations

from django.db import connection, transaction

from outbox_farm import Farm

farm = Farm()


def place_order(customer: str, total_cents: int) -> int:
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO orders (customer, total_cents) VALUES (%s, %s) RETURNING id",
                [customer, total_cents],
            )
            order_id = int(cursor.fetchone()[0])
        farm.publish(
            connection.connection,
            {"order_id": order_id, "customer": customer, "total_cents": total_cents},
            queue="order_placed",
        )
    return order_id
