"""The chaos and scale suite: faults under load, each run ending with the delivery checker.

    make chaos                      # every scenario, one table (about 15 minutes here)
    make chaos SCENARIO=pg-restart  # one of them (comma-separated for several)

See `scenarios.py` for what each does and asserts, `checks.py` for the results and the probes
of a running farm they are made of, `farms.py` for the farms and faults, and `load.py` for the
publishers.
"""
