"""The farm a relay-restart test or chaos scenario starts: `outbox-farm start
loadtests.restartapp:farm` from the repository's root, relaying queue `events` to the private
broker that `loadtests.restartable.Broker.env()` names (RESTART_KIND, RESTART_URL,
RESTART_NAME). The relay's retry strategy gives up at the first failure: a broker outage that
cost a row an attempt would put it in the DLQ at once, where the checks look."""

from __future__ import annotations

import os

from loadtests.restartable import target
from outbox_farm import Farm, NoRetry

farm = Farm()
farm.relay(
    "events",
    to=target(os.environ["RESTART_KIND"], os.environ["RESTART_URL"], os.environ["RESTART_NAME"]),
    batch=100,
    retry=NoRetry(),
)
