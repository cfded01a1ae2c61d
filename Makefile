# Every target creates the virtual environment on first use, so a fresh clone needs only Python 3.11+.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: venv test lint demo bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,demo]"
	touch $@

venv: $(VENV)/.installed

lint: venv
	$(VENV)/bin/ruff format --check src tests examples benchmarks
	$(VENV)/bin/ruff check src tests examples benchmarks

# two test processes (pytest-xdist): JAX compiles are mostly single-threaded, so on two cores
# the suite took 6.5 instead of 9.6 minutes; `make test PYTEST_ARGS=` runs one process
PYTEST_ARGS ?= -n 2

test: lint
	$(PY) -m pytest $(PYTEST_ARGS) tests

demo: venv
	$(PY) -m dyndepth demo

bench: venv
	$(PY) benchmarks/bench.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
