"""`stats` numbers on a real database: exact while small, estimated past the limit, and read
from the farm's indexes (EXPLAIN), so they stay fast on a large table."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

from outbox_farm.admin import Count, queue_stats
from outbox_farm.admin.frames import stats_frames
from outbox_farm.cli import main
from outbox_farm.db.operator import OUTBOX_CONDITIONS, AdminSql, OutboxFigure
from outbox_farm.names import TableNames

NAMES = TableNames.build("outbox", "outbox_dlq")
Conn = psycopg.Connection[Any]

ROWS = """
INSERT INTO outbox (queue, payload, attempts_count, next_attempt_at, acquired_at, acquired_token,
                    lease_expires_at)
VALUES
 ('q', 'ready', 0, now() - interval '90 seconds', NULL, NULL, NULL),
 ('q', 'ready', 1, now() - interval '5 seconds', NULL, NULL, NULL),
 ('q', 'ready', 0, now(), NULL, NULL, NULL),
 ('q', 'later', 2, now() + interval '1 hour', NULL, NULL, NULL),
 ('q', 'later', 0, now() + interval '1 minute', NULL, NULL, NULL),
 ('q', 'leased', 0, now(), now(), gen_random_uuid(), now() + interval '1 minute'),
 ('q', 'expired', 0, now(), now(), gen_random_uuid(), now() - interval '1 second'),
 ('other', 'later', 0, now() + interval '1 hour', NULL, NULL, NULL)
"""

DEAD = """
INSERT INTO outbox_dlq (original_id, queue, payload, deliveries_count, created_at, failed_at,
                        failure_reason)
VALUES (1, 'q', 'x', 1, now(), now() - interval '10 minutes', 'rejected'),
       (2, 'q', 'x', 1, now(), now() - interval '5 hours', 'rejected'),
       (3, 'q', 'x', 1, now(), now() - interval '3 days', 'rejected'),
       (4, 'q', 'x', 1, now(), now() - interval '3 days', 'max_deliveries'),
       (5, 'dlq_only', 'x', 1, now(), now(), 'retry_terminal')
"""


def exact(n: int) -> Count:
    return Count(n, True)


def test_counts_per_queue_are_exact_while_small(conn: Conn) -> None:
    conn.execute(ROWS)
    conn.execute(DEAD)
    stats = {s.queue: s for s in queue_stats(conn, NAMES)}
    assert sorted(stats) == ["dlq_only", "other", "q"]
    q = stats["q"]
    assert q.counts == {
        "ready": exact(3),
        "scheduled": exact(2),
        "waiting": exact(0),
        "in_flight": exact(2),
        "expired": exact(1),
        "retrying": exact(2),
    }
    assert 90 <= q.oldest_ready_age < 120
    by_reason = {d.reason: (d.last_hour, d.last_day, d.total) for d in q.dlq}
    assert by_reason == {
        "max_deliveries": (exact(0), exact(0), exact(1)),
        "rejected": (exact(1), exact(2), exact(3)),
    }
    assert q.dlq_total("total") == exact(4)
    assert stats["other"].oldest_ready_age == 0
    assert stats["dlq_only"].counts["ready"] == exact(0)


def test_one_queue(conn: Conn) -> None:
    conn.execute(ROWS)
    assert [s.queue for s in queue_stats(conn, NAMES, "other")] == ["other"]


def test_past_the_limit_a_count_is_the_planners_estimate(conn: Conn) -> None:
    conn.execute("INSERT INTO outbox (queue, payload) SELECT 'q', 'x' FROM generate_series(1, 500)")
    conn.execute(
        "INSERT INTO outbox_dlq (original_id, queue, payload, deliveries_count, created_at, "
        "failed_at, failure_reason) SELECT g, 'q', 'x', 1, now(), now() - interval '2 days', "
        "'rejected' FROM generate_series(1, 300) AS g"
    )
    conn.execute("ANALYZE outbox")
    conn.execute("ANALYZE outbox_dlq")
    (q,) = queue_stats(conn, NAMES, exact_limit=100)
    assert not q.counts["ready"].exact
    assert 250 <= q.counts["ready"].value <= 1000
    assert q.counts["scheduled"] == exact(0)
    (dead,) = q.dlq
    assert dead.total.exact is False
    assert 150 <= dead.total.value <= 600


def plan_nodes(plan: Any) -> list[dict[str, Any]]:
    nodes, todo = [], [plan[0]["Plan"]]
    while todo:
        node = todo.pop()
        nodes.append(node)
        todo += node.get("Plans", [])
    return nodes


def explain(conn: Conn, statement: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    sql = AdminSql(NAMES)
    row = conn.execute(sql.render("admin_explain", statement=statement), params).fetchone()
    assert row is not None
    return plan_nodes(row[0])


@pytest.fixture
def big(conn: Conn) -> Conn:
    """50,000 rows of a busy queue and a few of queue q, with statistics."""
    conn.execute(
        "INSERT INTO outbox (queue, payload) SELECT 'busy', 'x' FROM generate_series(1, 50000)"
    )
    conn.execute(ROWS)
    conn.execute(
        "INSERT INTO outbox_dlq (original_id, queue, payload, deliveries_count, created_at, "
        "failure_reason) SELECT g, 'busy', 'x', 1, now(), 'rejected' "
        "FROM generate_series(1, 20000) AS g"
    )
    conn.execute(DEAD)
    conn.execute("VACUUM ANALYZE outbox")
    conn.execute("VACUUM ANALYZE outbox_dlq")
    return conn


@pytest.mark.parametrize(
    ("count", "index"),
    [
        ("ready", "outbox_pending_idx"),
        ("scheduled", "outbox_pending_idx"),
        ("in_flight", "outbox_lease_idx"),
        ("expired", "outbox_lease_idx"),
    ],
)
def test_counts_are_read_from_the_farms_indexes(big: Conn, count: OutboxFigure, index: str) -> None:
    sql = AdminSql(NAMES)
    statement = sql.render(
        "admin_explain", statement="admin_count", table="outbox", condition=OUTBOX_CONDITIONS[count]
    )
    row = big.execute(statement, {"queue": "q", "cap": 10_001}).fetchone()
    assert row is not None
    nodes = plan_nodes(row[0])
    assert index in {n.get("Index Name") for n in nodes}
    assert "Seq Scan" not in {n["Node Type"] for n in nodes}


@pytest.mark.parametrize(
    ("statement", "params", "index"),
    [
        ("outbox_queues", {}, "outbox_pending_idx"),
        ("dlq_queues", {}, "outbox_dlq_queue_failed_idx"),
        ("admin_oldest_ready", {"queue": "q"}, "outbox_pending_idx"),
        ("admin_dlq_newest", {"queue": "q", "cap": 10_001}, "outbox_dlq_queue_failed_idx"),
    ],
)
def test_queue_listing_and_ages_never_scan_the_table(
    big: Conn, statement: str, params: dict[str, Any], index: str
) -> None:
    nodes = explain(big, statement, params)
    assert index in {n.get("Index Name") for n in nodes}
    assert "Seq Scan" not in {n["Node Type"] for n in nodes}


def test_a_known_queue_without_rows_shows_with_zeros(conn: Conn) -> None:
    """A registered queue that is idle vanished from `stats`: only queues with rows showed."""
    conn.execute(ROWS)
    assert "idle" not in {s.queue for s in queue_stats(conn, NAMES)}
    stats = {s.queue: s for s in queue_stats(conn, NAMES, known=["idle", "q"])}
    assert sorted(stats) == ["idle", "other", "q"]
    idle = stats["idle"]
    assert idle.counts == dict.fromkeys(idle.counts, exact(0))
    assert (idle.oldest_ready_age, idle.dlq, idle.causes, idle.stalled) == (0, [], [], None)


def test_each_queue_shows_its_top_causes(conn: Conn) -> None:
    conn.execute(DEAD)
    conn.execute(
        "INSERT INTO outbox_dlq (original_id, queue, payload, deliveries_count, created_at, "
        "failure_reason, last_exception) SELECT g, 'q', 'x', 1, now(), 'retry_terminal', "
        "format('KeyError(%L)', 'sku-' || g) FROM generate_series(1, 30) AS g"
    )
    stats = {s.queue: s for s in queue_stats(conn, NAMES)}
    assert [(g.cause, g.rows) for g in stats["q"].causes] == [
        ("KeyError('sku-<n>')", 30),
        ("(no exception recorded)", 4),
    ]
    assert [(g.cause, g.rows) for g in stats["dlq_only"].causes] == [("(no exception recorded)", 1)]


class Metrics(http.server.BaseHTTPRequestHandler):
    """A farm's /metrics serving queue `idle`: its series exist from the start, at zero."""

    body = (
        b"# TYPE outbox_farm_delivery_lag_seconds histogram\n"
        b'outbox_farm_delivery_lag_seconds_bucket{le="+Inf",queue="idle"} 0.0\n'
        b'outbox_farm_delivery_lag_seconds_count{queue="idle"} 0.0\n'
        b'outbox_farm_delivery_lag_seconds_sum{queue="idle"} 0.0\n'
    )

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        return None


@pytest.fixture
def metrics_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


def test_stats_shows_the_queues_the_running_farm_serves(conn: Conn, metrics_url: str) -> None:
    conn.execute(ROWS)
    args: dict[str, Any] = {"queue": None, "exact_limit": 100, "every": None}
    (alone,) = stats_frames(conn, NAMES, metrics_url="", **args)
    assert [q.queue for q in alone["queues"]] == ["other", "q"]
    (frame,) = stats_frames(conn, NAMES, metrics_url=metrics_url, **args)
    assert "error" not in frame["farm"]
    assert [q.queue for q in frame["queues"]] == ["idle", "other", "q"]


def test_stats_shows_the_queues_the_app_registers(
    dsn: str, conn: Conn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "idleapp.py").write_text(
        "from outbox_farm import Farm\n"
        "farm = Farm(table='outbox', dlq_table='outbox_dlq')\n"
        "@farm.handler('idle_q')\n"
        "async def handle(msg):\n"
        "    pass\n"
    )
    monkeypatch.chdir(tmp_path)
    conn.execute(ROWS)
    base = ["stats", "--dsn", dsn, "--metrics-url", "", "--json"]
    without = CliRunner().invoke(main, base)
    assert without.exit_code == 0, without.output
    assert [q["queue"] for q in json.loads(without.stdout)["queues"]] == ["other", "q"]
    result = CliRunner().invoke(main, [*base, "--app", "idleapp:farm"])
    assert result.exit_code == 0, result.output
    queues = {q["queue"]: q for q in json.loads(result.stdout)["queues"]}
    assert sorted(queues) == ["idle_q", "other", "q"]
    assert queues["idle_q"]["counts"]["ready"] == {"value": 0, "exact": True}
    text = CliRunner().invoke(
        main, ["stats", "--dsn", dsn, "--metrics-url", "", "--app", "idleapp"]
    )
    assert text.exit_code == 0, text.output
    assert any(line.split()[:2] == ["idle_q", "0"] for line in text.stdout.splitlines())


def test_a_paused_queue_shows_paused_and_not_stalled(conn: Conn) -> None:
    from outbox_farm.admin import limit_queue, pause_queue
    from outbox_farm.limits import Limits, Rate

    conn.execute(ROWS)  # q's oldest ready row waited 90 s with nothing of it leased but...
    conn.execute("DELETE FROM outbox WHERE acquired_token IS NOT NULL")  # ...now nothing is
    before = {s.queue: s for s in queue_stats(conn, NAMES, stall_after=60)}
    assert before["q"].stalled is not None  # the positive control: an idle q is a stall
    assert not before["q"].paused

    pause_queue(conn, NAMES, "q", reason="maintenance", seconds=3600)
    limit_queue(conn, NAMES, "empty", rate=Rate(100, 1.0), max_running=3)
    stats = {s.queue: s for s in queue_stats(conn, NAMES, stall_after=60)}
    q = stats["q"]
    assert q.paused
    assert q.pause_reason == "maintenance"
    assert q.paused_until is not None
    assert q.stalled is None
    assert stats["empty"].limits == Limits(Rate(100, 1.0), 3)  # a queue without rows shows
    assert not stats["empty"].paused
    assert stats["other"].limits == Limits()

    result = CliRunner().invoke(
        main, ["stats", "--dsn", conn.info.dsn, "--metrics-url", "", "--table", "outbox"]
    )
    assert result.exit_code == 0, result.output
    table = result.output.split("\n\n")[0]  # the figures, before the notes and other tables
    lines = {line.split()[0]: line.split() for line in table.splitlines()}
    assert lines["queue"][-2:] == ["paused", "stalled"]
    assert lines["q"][-2:] == ["PAUSED", "-"]
    assert lines["other"][-2:] == ["-", "-"]
    assert "Paused and limited" in result.output
    assert "(maintenance)" in result.output
    assert "rate 100/s, at most 3 running" in result.output


def test_stats_without_the_controls_table_shows_the_rest(conn: Conn) -> None:
    conn.execute(ROWS)
    conn.execute("DROP TABLE outbox_farm_queues")
    stats = {s.queue: s for s in queue_stats(conn, NAMES)}
    assert sorted(stats) == ["other", "q"]
    assert not stats["q"].paused
