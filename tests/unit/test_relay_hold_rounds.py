"""The hold's bookkeeping (`relay.hold.Held`), without a broker: which unanswered rows are
held, which are judged at fault, and what the next round sends."""

from __future__ import annotations

from outbox_farm.relay.hold import Held, Suspects


def test_rows_unanswered_with_nothing_confirmed_are_held_on_any_connection() -> None:
    held = Held(3, since=0)
    assert held.record([0, 1, 2], [0, 1, 2], anew=False, confirms=0) == []
    assert held.record([0, 1, 2], [0, 1, 2], anew=True, confirms=0) == []
    for probe in (0, 1, 2, 0):
        assert held.next_round() == [probe]
        assert held.record([probe], [probe], anew=True, confirms=0) == []
    assert sorted(held.rows) == [0, 1, 2]  # held, none blamed: the broker confirmed nothing


def test_a_fruitless_round_on_a_new_connection_makes_the_next_rounds_probe() -> None:
    held = Held(4, since=0)
    assert held.record([0, 1, 2, 3], [0, 1, 2, 3], anew=False, confirms=0) == []
    assert held.next_round() == [0, 1, 2, 3]  # a stale connection: all again, on a new one
    assert held.record([0, 1, 2, 3], [0, 1, 2, 3], anew=True, confirms=0) == []
    assert held.next_round() == [0]  # a probe
    assert held.record([0], [], anew=True, confirms=1) == []
    assert held.next_round() == [1, 2]  # twice as many after an answered round
    assert held.record([1, 2], [], anew=False, confirms=3) == []
    assert held.next_round() == [3]  # all that is left
    assert held.record([3], [], anew=False, confirms=4) == []
    assert held.rows == []


def test_a_row_unanswered_twice_on_new_connections_while_others_confirm_is_at_fault() -> None:
    held = Held(3, since=10)
    assert held.record([0, 1, 2], [1], anew=False, confirms=12) == []  # not a new connection
    assert held.rows == [1]
    assert held.record([1], [1], anew=True, confirms=12) == []  # strike one
    assert held.record([1], [1], anew=True, confirms=12) == [1]  # strike two: its own fault
    assert held.rows == []


def test_a_failed_probe_waits_behind_the_others_and_a_suspect_fails_at_its_first_strike() -> None:
    held = Held(3, since=0, suspects=[2])
    held.record([0, 1, 2], [0, 1, 2], anew=True, confirms=0)  # probing from here
    assert held.record([0], [0], anew=True, confirms=0) == []
    assert held.rows == [1, 2, 0]
    assert held.record([1], [], anew=True, confirms=1) == []
    assert held.next_round() == [2, 0]
    assert held.record([2, 0], [2, 0], anew=True, confirms=1) == []  # blames neither
    assert held.next_round() == [2]
    assert held.record([2], [2], anew=True, confirms=1) == [2]  # the suspect, alone: at once
    assert held.rows == [0]


def test_suspects_keep_the_latest_ids() -> None:
    suspects = Suspects()
    assert not suspects
    for row_id in range(5000):
        suspects.add(row_id)
    assert 4999 in suspects
    assert 0 not in suspects
