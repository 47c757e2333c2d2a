# metalguard: `make demo` and `make test` are the two commands (see README.md).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP_RUN := $(VENV)/.installed-run
STAMP_DEV := $(VENV)/.installed-dev

.PHONY: install demo test check lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP_RUN): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(STAMP_DEV): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@ $(STAMP_RUN)

## install: create .venv and install the metalguard CLI into it
install: $(STAMP_RUN)

## demo: run the demo (embedded NATS, controllers, simulated fleet)
demo: $(STAMP_RUN)
	$(BIN)/metalguard demo

# pytest workers for `make test`: its tests mostly wait (servers, timers, child processes,
# VMs), so more workers than the 2 cores pays (docs/testing.md has the measurements).
# Tests that need one resource at a time share an xdist_group (--dist loadgroup).
WORKERS ?= 4
# pytest-randomly's seed for the order: a fresh one each run, printed; `make test SEED=N`
# runs that order again.
ifeq ($(origin SEED), undefined)
SEED    := $(shell od -An -N4 -tu4 /dev/urandom | tr -d ' ')
endif
STAGE   := bash .ci/stage

## test: ruff, mypy, the layering contracts, then the whole pytest suite in parallel,
## in a random order (pytest-randomly; its seed is printed), the 25 slowest tests listed
test: $(STAMP_DEV)
	$(STAGE) tools bash tests/ensure-tools.sh
	$(STAGE) ruff $(BIN)/ruff check .
	$(STAGE) format $(BIN)/ruff format --check .
	$(STAGE) mypy $(BIN)/mypy
	$(STAGE) lint-imports $(BIN)/lint-imports --no-cache
	@echo "pytest order seed: $(SEED) (make test SEED=$(SEED) runs this order again)"
	$(STAGE) pytest $(BIN)/pytest -q -ra -n $(WORKERS) --dist loadgroup --durations=25 \
		--randomly-seed=$(SEED)

## check: the loop after every edit (< 2 min): ruff, mypy, the layering contracts and the
## unit tests (no server, no subprocess, no root)
check: $(STAMP_DEV)
	$(STAGE) ruff $(BIN)/ruff check .
	$(STAGE) format $(BIN)/ruff format --check .
	$(STAGE) mypy $(BIN)/mypy
	$(STAGE) lint-imports $(BIN)/lint-imports --no-cache
	$(STAGE) unit $(BIN)/pytest -q -n 2 tests/unit

lint: $(STAMP_DEV)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
