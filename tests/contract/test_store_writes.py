"""Outcome writes, the same on both stores: each matches id and token, a row held under another
token (or gone) is left as it is, and `Written.matched` names the rows written by their
positions in the write."""

from __future__ import annotations

import uuid
from datetime import timedelta

from outbox_farm import storage
from outbox_farm.outcome import Kind, Outcome, Reason
from outbox_farm.worker.completer import Completer
from tests.contract.conftest import Outbox, close_to


async def test_an_ack_deletes_only_the_rows_held_under_its_tokens(outbox: Outbox) -> None:
    ids = await outbox.publish_batch([b"1", b"2", b"3"], queue="q")
    token = (await outbox.claim())[0].lease_token
    written = await outbox.write(storage.ack(ids, [token, uuid.uuid4(), token]))
    assert written.matched == {0, 2}
    assert [await outbox.gone(i) for i in ids] == [True, False, True]
    kept = await outbox.row(ids[1])
    assert kept.acquired_token == token
    assert (await outbox.write(storage.ack(ids[:1], [token]))).matched == set()  # gone


async def test_a_retry_frees_the_row_until_its_delay_and_counts_a_run(outbox: Outbox) -> None:
    row_id = await outbox.publish(b"x", queue="q")
    [msg] = await outbox.claim()
    started = msg.claimed_at
    retry = storage.retry([row_id], [msg.lease_token], delays=[30], ran=[True], started=[started])
    assert (await outbox.write(retry)).matched == {0}
    row = await outbox.row(row_id)
    assert (row.acquired_token, row.acquired_at, row.lease_expires_at) == (None, None, None)
    assert (row.deliveries_count, row.attempts_count) == (1, 1)
    assert (row.first_attempt_at, row.last_attempt_at) == (started, started)
    assert close_to(row.next_attempt_at, await outbox.now() + timedelta(seconds=30))
    assert await outbox.claim() == []
    await outbox.later(31)
    [again] = await outbox.claim()
    assert (again.deliveries_count, again.attempts_count) == (2, 1)
    assert close_to(again.first_attempt_at, again.claimed_at - timedelta(seconds=31))


async def test_attempts_count_runs_and_keep_the_first_one(outbox: Outbox) -> None:
    """The first run's time stays; the last run's is the latest; a retry of a row that never
    ran (its handler never started) counts no attempt and dates none."""
    row_id = await outbox.publish(b"x", queue="q")
    runs = []
    for ran in (True, True, False):
        [msg] = await outbox.claim()
        started = msg.claimed_at if ran else None
        runs.append(started)
        retry = storage.retry([row_id], [msg.lease_token], delays=[0], ran=[ran], started=[started])
        assert (await outbox.write(retry)).matched == {0}
    row = await outbox.row(row_id)
    assert (row.deliveries_count, row.attempts_count) == (3, 2)
    assert (row.first_attempt_at, row.last_attempt_at) == (runs[0], runs[1])


async def test_a_retry_under_another_token_changes_nothing(outbox: Outbox) -> None:
    row_id = await outbox.publish(b"x", queue="q")
    [msg] = await outbox.claim()
    before = await outbox.row(row_id)
    retry = storage.retry([row_id], [uuid.uuid4()], delays=[30], ran=[True], started=[None])
    assert (await outbox.write(retry)).matched == set()
    assert await outbox.row(row_id) == before
    assert before.acquired_token == msg.lease_token


async def test_a_release_frees_the_row_at_once_and_takes_back_its_delivery(
    outbox: Outbox,
) -> None:
    row_id = await outbox.publish(b"x", queue="q")
    [msg] = await outbox.claim()
    assert (await outbox.write(storage.release([row_id], [uuid.uuid4()]))).matched == set()
    assert (await outbox.write(storage.release([row_id], [msg.lease_token]))).matched == {0}
    row = await outbox.row(row_id)
    assert (row.acquired_token, row.deliveries_count, row.attempts_count) == (None, 0, 0)
    [again] = await outbox.claim()
    assert (again.id, again.deliveries_count) == (row_id, 1)


async def test_a_dlq_move_archives_the_row_as_it_deletes_it(outbox: Outbox) -> None:
    moved = await outbox.publish({"n": 1}, queue="q", headers={"h": "v"}, timer_id="t")
    bare = await outbox.publish(b"bare", queue="q")
    held = await outbox.publish(b"held", queue="q")
    msgs = {msg.id: msg for msg in await outbox.claim()}
    created = (await outbox.row(moved)).created_at
    token = msgs[moved].lease_token
    write = storage.dead_letter(
        [moved, bare, held],
        [token, token, uuid.uuid4()],
        reasons=["retry_terminal", "rejected", "rejected"],
        exceptions=["ValueError('x')", None, None],
    )
    assert (await outbox.write(write)).matched == {0, 1}
    assert await outbox.gone(moved)
    assert not await outbox.gone(held)
    first, second = await outbox.dead_letters()
    assert (first.original_id, first.queue, first.payload, first.timer_id) == (
        moved,
        "q",
        b'{"n":1}',
        "t",
    )
    assert first.headers == msgs[moved].headers
    assert (first.deliveries_count, first.created_at) == (1, created)
    assert (first.failure_reason, first.last_exception) == ("retry_terminal", "ValueError('x')")
    assert close_to(first.failed_at, await outbox.now())
    assert (second.original_id, second.failure_reason, second.last_exception) == (
        bare,
        "rejected",
        None,
    )


async def test_without_a_dlq_a_terminal_row_is_deleted(outbox: Outbox) -> None:
    await outbox.without_dlq()
    assert not outbox.store.has_dlq
    row_id = await outbox.publish(b"x", queue="q")
    [msg] = await outbox.claim()
    terminal = Outcome(
        Kind.TERMINAL, row_id, msg.lease_token, "q", 1, reason=Reason.REJECTED, last_exception="x"
    )
    await Completer(outbox.store).write([terminal])
    assert await outbox.gone(row_id)
    assert await outbox.dead_letters() == []


async def test_the_writes_of_one_flush_each_apply(outbox: Outbox) -> None:
    acked, retried, released = await outbox.publish_batch([b"1", b"2", b"3"], queue="q")
    token = (await outbox.claim())[0].lease_token
    async with outbox.store.flush() as flush:
        assert (await flush.send(storage.ack([acked], [token]))).matched == {0}
        retry = storage.retry([retried], [token], delays=[60], ran=[False], started=[None])
        assert (await flush.send(retry)).matched == {0}
        assert (await flush.send(storage.release([released], [token]))).matched == {0}
    assert await outbox.gone(acked)
    assert [m.id for m in await outbox.claim()] == [released]
