"""What the load test, the chaos and scale suites and the benchmarks stand on alike.

The server, the scratch database and the farm as a subprocess (`harness`, `farmproc`); the
harness's tables (`tables`) and its one wait (`waits`); the scenario's queues and fates
(`scenario`), publishing with an expectation (`expected`), the ledger (`ledger`), the drain
(`drain`) and the delivery checker (`checker`, `invariants`, `counter_checks`); the farms
started under test (`farmapp`, `relayapp`, `restartapp`) and the brokers and consumer they
relay to (`relaymode`, `relay_consumer`, `kafkabroker`, `restartable`).
"""
