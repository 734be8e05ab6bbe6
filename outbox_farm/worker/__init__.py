"""One process's machinery: the data path from a claimed row to its written outcome.

`runtime` builds and stops it; per queue, `fetcher` claims into the in-flight ledger
(`inflight`), `executor` runs handlers through the one call path (`invoke`), `completer` writes
the outcomes (`writes`); `heartbeat` extends the leases held and `listener` relays NOTIFY
wake-ups. The fetchers, the completer and the heartbeats speak only the storage port
(`outbox_farm.storage`); the signals the completer and the fetchers send each other are drawn
in `channels`. Every long-running task is supervised (`supervised`); permanent database errors
are kept for health checks (`problems`).
"""
