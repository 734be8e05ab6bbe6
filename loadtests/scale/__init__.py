"""Several hosts over a network, with faults between them: `python -m loadtests.scale`.

Hosts are Linux network namespaces on one bridge: a database host running a Postgres of its
own, farm hosts each running `outbox-farm start`, and a producer host. Every namespace shares
the one kernel, so `time.time()` in one host is comparable with `time.time()` in another, which
is what lets the lag be measured from a commit on the producer host to a handler start on a farm
host without any clock synchronisation.
"""
