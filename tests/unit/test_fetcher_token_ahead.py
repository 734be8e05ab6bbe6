"""The fetcher makes its next claim's lease token while it rests: each token still goes to one
claim alone, the loop's claims and the completer's hand-overs alike."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial

from outbox_farm.handler import HandlerSpec
from outbox_farm.observe import observers
from outbox_farm.storage import Claim
from outbox_farm.testing.memory import MemoryStore
from outbox_farm.tokens import token_range
from outbox_farm.worker.completer import Completer
from outbox_farm.worker.fetcher import Fetcher
from outbox_farm.worker.inbox import Inbox


def test_a_token_made_in_a_rest_goes_to_the_next_claim_alone() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        spec = HandlerSpec(queue="q", func=lambda msg: None)
        fetcher = Fetcher(spec, store, Inbox(), observers(), Completer(store), worker_id=7)
        tokens = []
        takes: list[Callable[[], Claim]] = [partial(fetcher._new_claim, 5), fetcher.handover]
        for take in takes:
            assert not await fetcher._rest(0.0)  # nothing woke it: the wait ran out
            ahead = fetcher._token
            assert ahead is not None
            tokens.append(take().token)
            assert tokens[-1] is ahead
            tokens.append(fetcher._new_claim(5).token)  # no rest between: a fresh one
        assert len(set(tokens)) == len(tokens)
        low, high = token_range(7)
        assert all(low <= token <= high for token in tokens)

    asyncio.run(scenario())
