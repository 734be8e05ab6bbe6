"""Load tests and benchmarks of outbox_farm, run against a real PostgreSQL on loopback.

A package so that the benchmarks (`python -m loadtests.bench`) and the load test share one
harness (`harness.py`); the load-test files that run by path (`run_loadtest.py`,
`checker.py`, the Locust file and the farm under test) put the repository root on `sys.path`
to import it. See `loadtests/README.md`.
"""
