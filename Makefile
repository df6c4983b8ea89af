# Two commands on a fresh machine: `make verify` and `make test`; each sets up .venv when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HYPOTHESIS_PROFILE ?= ci
export HYPOTHESIS_PROFILE
# The kernel is checked on CPU under the Triton interpreter.
export TRITON_INTERPRET ?= 1
PYTEST_ARGS ?= -n 2

.PHONY: setup test verify lint prove bench mutants repro precision clean

setup: $(STAMP)

# torch is pinned here: 2.13.0 is the CPU build on disk; an open range pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

verify: setup
	$(BIN)/python -m exactness verify $(VERIFY_ARGS)

precision: setup
	TRITON_INTERPRET=0 $(BIN)/python -m exactness precision

mutants: setup
	$(BIN)/python -m exactness mutants

repro: setup
	$(BIN)/python -m exactness repro $(FILE)

prove: setup
	$(BIN)/python -m exactness prove

bench: setup
	TRITON_INTERPRET=0 $(BIN)/python bench/bench_forward.py
	TRITON_INTERPRET=0 $(BIN)/python -m bench.bench_moe

lint: setup
	$(BIN)/ruff check exactness tests proofs bench conftest.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis reports
