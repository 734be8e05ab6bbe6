"""The operator's controls of a queue reach every farm: the NOTIFY a change sends."""

from __future__ import annotations

import psycopg

from outbox_farm.db.control import notify_changed
from outbox_farm.names import TableNames
from outbox_farm.storage import is_control

NAMES = TableNames.build("outbox", "outbox_dlq")


def test_a_change_notifies_the_farms_channel_once_its_transaction_commits(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as listening:
        listening.execute(f"LISTEN {NAMES.channel}")
        with psycopg.connect(dsn) as conn:
            notify_changed(conn, NAMES, "emails")
            conn.rollback()
            notify_changed(conn, NAMES, "emails")
        payloads = [n.payload for n in listening.notifies(timeout=2.0, stop_after=1)]
    assert len(payloads) == 1
    assert is_control(payloads[0])
    assert payloads[0].endswith("emails")
    assert not is_control("emails")
