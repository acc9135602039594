# Postbox developer commands. `make test` and `make demo` work on a fresh machine with only Python:
# without POSTBOX_DATABASE_URL / POSTBOX_TEST_DATABASE_URL an embedded PostgreSQL is started.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# Test files run in TEST_WORKERS processes (pytest-xdist, a file's tests in one process); 0 runs
# them in this one.
TEST_WORKERS ?= 2

.PHONY: install lint test test-all chaos bench bench-quick demo clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[all,binary,embedded,console,dev]'
	touch $(STAMP)

install: $(STAMP)

lint: install
	$(BIN)/ruff check service tests migrations
	$(BIN)/ruff format --check service tests migrations
	$(BIN)/mypy
	$(BIN)/lint-imports

test: lint
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

BENCH_STAMP := $(VENV)/.bench-stamp

$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[all,binary,embedded,console,dev,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python -m tests.bench

bench-quick: $(BENCH_STAMP)
	$(BIN)/python -m tests.bench --quick

demo: install
	$(BIN)/postbox demo

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis bench-results

# Fault injection (tests/chaos): every fault F1..F7 for CHAOS_ITERATIONS cycles (default 20), a
# table of the figures, and bench-results/chaos-*.json. Needs the brokers of `make test`.
chaos: install
	$(BIN)/python -m tests.chaos
