"""A batch handler's options are checked when it is registered, not when its first batch
forms: a worker with a bad one never starts."""

from __future__ import annotations

from typing import Any

import pytest

from outbox_farm import ConfigurationError, Farm, Message


@pytest.mark.parametrize(
    "options",
    [
        {"batch": 0},
        {"batch": 2.5},
        {"batch": True},
        {"batch": 5, "linger": -1.0},
        {"batch": 5, "linger": 5.0, "lease_ttl": 10.0},
    ],
)
def test_bad_batch_options_are_refused_at_registration(options: dict[str, Any]) -> None:
    async def handle(msgs: list[Message]) -> None:
        return None

    with pytest.raises(ConfigurationError):
        Farm().handler("q", **options)(handle)
