"""outbox_farm's benchmarks: `python -m loadtests.bench` is the standard report; each family
also runs alone as `python -m loadtests.bench.<producer|runtime|farm|stats|console|...>`.

What they share (the server, the scratch database, time limits, percentiles, the server's
statistics, the tables they print) is in `common.py`, `report.py` and `loadtests.common`
(`harness.py`, `tables.py`), so that a figure means the same thing in every report. See
`loadtests/README.md`.
"""
