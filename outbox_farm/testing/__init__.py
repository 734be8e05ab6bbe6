"""A test kit for applications built on outbox_farm.

- `drain(farm, dsn)`: run the farm's handlers on what the outbox holds, in the test's process,
  until nothing is due (with `within=` seconds of clock moved forward instead of slept);
  returns a `Drained`, one `Run` per verdict (acked, retried, dead-lettered, and why).
- `record(farm)`: publishes kept in memory for unit tests without a database; the
  `Recorder` runs the handlers on them under the same outcome rules.
- `MemoryStore(farm)`: an outbox in memory with the Postgres store's semantics (leases, tokens,
  ordering keys, timers, DLQ), which the farm's real runtime runs over (`running()`), on a
  clock a test may move by hand (`ManualClock`); see `memory` for what it does not model.
- A pytest plugin (installed with the package): the `outbox_dsn`, `outbox_drain`,
  `outbox_recorder`, `outbox_app` and `outbox_server` fixtures; see `plugin`.
"""

from .drain import DrainTimeout, adrain, drain
from .memory import MemoryStore
from .memory_rows import DeadLetter, ManualClock, Row
from .recorder import Recorder, record
from .results import Drained, Run, Status

__all__ = [
    "DeadLetter",
    "DrainTimeout",
    "Drained",
    "ManualClock",
    "MemoryStore",
    "Recorder",
    "Row",
    "Run",
    "Status",
    "adrain",
    "drain",
    "record",
]
