"""The supervisor: `outbox-farm start`'s arbiter and the worker processes it forks.

The arbiter (`arbiter`) forks, watches, restarts (`restarts`, `handback`) and drains the
workers; each child (`child`) loads the app (`app`) and runs one `worker` runtime. The endpoint
(`exposition`) serves every process's metrics from the shared directory (`metrics_dir`).
Nothing here claims or writes rows: that is the `worker` wing's.
"""
