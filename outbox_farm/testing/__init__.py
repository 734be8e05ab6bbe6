"""A test kit for applications built on outbox_farm.

- `drain(farm, dsn)`: run the farm's handlers on what the outbox holds, in the test's process,
  until nothing is due (with `within=` seconds of clock moved forward instead of slept);
  returns a `Drained`, one `Run` per verdict (acked, retried, dead-lettered, and why).
- `record(farm)`: publishes kept in memory for unit tests without a database; the
  `Recorder` runs the handlers on them under the same outcome rules.
- A pytest plugin (installed with the package): the `outbox_dsn`, `outbox_drain`,
  `outbox_recorder`, `outbox_app` and `outbox_server` fixtures; see `plugin`.
"""

from .drain import DrainTimeout, adrain, drain
from .recorder import Recorder, record
from .results import Drained, Run, Status

__all__ = ["DrainTimeout", "Drained", "Recorder", "Run", "Status", "adrain", "drain", "record"]
