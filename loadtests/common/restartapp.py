"""The farm a relay-restart test or chaos scenario starts: `outbox-farm start
loadtests.common.restartapp:farm` from the repository's root, relaying queue `events` to the
private broker that `loadtests.common.restartable.Broker.env()` names (RESTART_KIND,
RESTART_URL, RESTART_NAME).

The relay's retry strategy gives up at a row's first failure, so a row that spent an attempt on
the outage lands in the DLQ, where the checks look. One failure is retried: a topic that does
not exist. A restarted tansu forgot its topics, and rows sent between its start and the topic's
creation (the load goes on meanwhile) are unroutable, which is a row's route problem by design
(the retry strategy gives an operator time to make the topic), not an outage.
"""

from __future__ import annotations

import os

from loadtests.common.restartable import target
from outbox_farm import Farm
from outbox_farm.relay.runner import Unroutable

TOPIC_WAIT = 60.0  # seconds a row may wait for its topic to be made again


class OnlyMissingTopics:
    def next_delay(self, attempt: int, exc: BaseException, elapsed: float) -> float | None:
        return 0.5 if isinstance(exc, Unroutable) and elapsed < TOPIC_WAIT else None


farm = Farm()
farm.relay(
    "events",
    to=target(os.environ["RESTART_KIND"], os.environ["RESTART_URL"], os.environ["RESTART_NAME"]),
    batch=100,
    retry=OnlyMissingTopics(),
)
