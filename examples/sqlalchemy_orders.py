"""Publishing from a SQLAlchemy 2 session (the psycopg 3 driver, `postgresql+psycopg://`).

The outbox row goes through the session's own DBAPI connection, so it is part of the session's
transaction: `session.begin()` commits the order and the event together, and a rollback
discards both.
"""

from __future__ import annotations

from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from outbox_farm import Farm

farm = Farm()


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str] = mapped_column(String(100))
    total_cents: Mapped[int]


def place_order(session: Session, customer: str, total_cents: int) -> int:
    with session.begin():
        order = Order(customer=customer, total_cents=total_cents)
        session.add(order)
        session.flush()  # the INSERT runs now, so the order has its id
        driver_connection = session.connection().connection.driver_connection
        farm.publish(
            driver_connection,
            {"order_id": order.id, "customer": customer, "total_cents": total_cents},
            queue="order_placed",
        )
        return order.id
