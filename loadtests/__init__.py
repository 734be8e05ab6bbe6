"""Load tests and benchmarks of outbox_farm, run against a real PostgreSQL on loopback.

Four wings over one shared package: the load test (`load`, Locust's publishers), the chaos
suite (`chaos`), the multi-host scale suite (`scale`) and the benchmarks (`bench`), each
standing on `common` (the harness, the farms under test, the drain and the checker). The
files that run by path (`load/run_loadtest.py`, `load/locustfile.py`, `common/checker.py`)
put the repository root on `sys.path` to import it. See `loadtests/README.md`.
"""
