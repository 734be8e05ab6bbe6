"""The load test: Locust publishers against a real farm, drained, then checked.

    python loadtests/load/run_loadtest.py --smoke

`run_loadtest.py` runs it all; `locust_run.py` runs Locust as a subprocess over
`locustfile.py`, the publishers. The farm, its checker and everything else it shares with the
chaos and scale suites is in `loadtests.common`. See `loadtests/README.md`.
"""
