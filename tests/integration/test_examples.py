"""The README's publishing recipes, as the apps in `examples/` use them, against a real
Postgres: the order and its outbox row commit together, and roll back together."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ORDERS = "CREATE TABLE orders (id serial PRIMARY KEY, customer text NOT NULL, total_cents int)"


def example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # SQLAlchemy resolves the models' annotations through it
    spec.loader.exec_module(module)
    return module


def published(conn: psycopg.Connection[Any]) -> list[tuple[str, Any]]:
    conn.commit()
    rows = conn.execute("SELECT queue, convert_from(payload, 'UTF8') FROM outbox ORDER BY id")
    return [(queue, body) for queue, body in rows.fetchall()]


def orders(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM orders").fetchone()
    assert row is not None
    return int(row[0])


def test_plain_psycopg(conn: psycopg.Connection[Any]) -> None:
    conn.execute(ORDERS)
    conn.commit()
    plain = example("plain_psycopg")
    order_id = plain.place_order(conn, "ada", 1200)
    assert published(conn) == [
        ("order_placed", f'{{"order_id":{order_id},"customer":"ada","total_cents":1200}}')
    ]

    def publish_then_fail() -> None:
        with conn.transaction():
            plain.place_order(conn, "bob", 99)
            raise RuntimeError("the caller's transaction fails after publishing")

    with pytest.raises(RuntimeError):
        publish_then_fail()
    assert orders(conn) == 1
    assert len(published(conn)) == 1


def test_sqlalchemy_session(dsn: str, conn: psycopg.Connection[Any]) -> None:
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from sqlalchemy.orm import Session

    orm = example("sqlalchemy_orders")
    engine = sqlalchemy.create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(dsn))
    try:
        orm.Base.metadata.create_all(engine)
        with Session(engine) as session:
            order_id = orm.place_order(session, "ada", 1200)
        assert published(conn) == [
            ("order_placed", f'{{"order_id":{order_id},"customer":"ada","total_cents":1200}}')
        ]

        def publish_then_fail() -> None:
            with Session(engine) as session, session.begin():
                session.add(orm.Order(customer="bob", total_cents=99))
                session.flush()
                driver = session.connection().connection.driver_connection
                orm.farm.publish(driver, {"order": "bob"}, queue="order_placed")
                raise RuntimeError("the session's transaction fails after publishing")

        with pytest.raises(RuntimeError):
            publish_then_fail()
        assert orders(conn) == 1
        assert len(published(conn)) == 1
    finally:
        engine.dispose()


def test_django_atomic(dsn: str, conn: psycopg.Connection[Any]) -> None:
    pytest.importorskip("django")
    import django
    from django.conf import settings
    from django.db import connection, transaction

    conn.execute(ORDERS)
    conn.commit()
    params = conninfo_to_dict(dsn)
    database = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": params["dbname"],
        "USER": params.get("user", ""),
        "PASSWORD": params.get("password", ""),
        "HOST": params.get("host", ""),
        "PORT": params.get("port", ""),
    }
    if not settings.configured:
        settings.configure(DATABASES={"default": database}, USE_TZ=True)
        django.setup()
    connection.settings_dict.update(database)
    connection.close()
    try:
        orders_app = example("django_orders")
        order_id = orders_app.place_order("ada", 1200)
        assert published(conn) == [
            ("order_placed", f'{{"order_id":{order_id},"customer":"ada","total_cents":1200}}')
        ]

        def publish_then_fail() -> None:
            with transaction.atomic():
                orders_app.place_order("bob", 99)  # a savepoint inside the outer block
                raise RuntimeError("the outer atomic block fails after publishing")

        with pytest.raises(RuntimeError):
            publish_then_fail()
        assert orders(conn) == 1
        assert len(published(conn)) == 1
    finally:
        connection.close()
