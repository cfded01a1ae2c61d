# Every target creates the virtual environment on first use, so a fresh clone needs only Python 3.11+.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: venv test test-full test-floor lint demo bench docs docs-test dist clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,demo,docs]"
	touch $@

venv: $(VENV)/.installed

lint: venv
	$(VENV)/bin/ruff format --check src tests examples benchmarks docs
	$(VENV)/bin/ruff check src tests examples benchmarks docs

# two test processes (pytest-xdist): JAX compiles are mostly single-threaded, so two cores run
# two at once (a fresh clone's `make test`, the venv included from pip's cache, took 12.7
# minutes on this project's 2-core machine, 2026-12-04, 850 tests; 22.9 on a slower one,
# 2026-12-07, 1,232 tests, 30.5 there before the covering subsets of tests/shared_lists.py);
# three processes ran a test file slower than two; `make test PYTEST_ARGS=` runs one process.
# Work stealing: the load scheduler left one process idle for 2-2.5 minutes at the end while the
# other ran its last long tests. tests/conftest.py compiles at XLA's CPU backend level 0, with
# its older fusion emitters, except with DYNDEPTH_FULL=1 (30.8 minutes before the emitters' flag
# in one run of `make test`'s pytest, 22.2 after; a fresh clone's `make test` then took 22.7
# minutes, 1,271 tests, 2026-12-07).
# The suite includes the documentation (tests/packaging/test_docs.py runs its code,
# tests/packaging/test_site.py builds the site and checks its pages) and the packaging
# (tests/packaging/test_wheel.py).
PYTEST_ARGS ?= -n 2 --dist worksteal

test: lint
	$(PY) -m pytest $(PYTEST_ARGS) tests

# The oldest jax the project supports (pyproject.toml's `jax>=` floor), in a virtual environment of
# its own (.venv-floor, jax and jaxlib pinned to the floor): the README's code (the quickstart
# included), every loop on a 4x2 Explicit mesh (8 simulated devices) and JAX's testScanGrad in its
# jitted form. About a minute and a half on the project's 2-core machine, the venv included.
FLOOR_VENV ?= .venv-floor
JAX_FLOOR := $(shell sed -n 's/.*"jax>=\([0-9.]*\)".*/\1/p' pyproject.toml)
FLOOR_TESTS := "tests/packaging/test_docs.py::test_page_code_runs[README.md]" \
	tests/multi_device/test_explicit_batch_depth.py \
	"tests/core/test_second_order_forms.py::test_jax_scan_grad[jit_scan=True-jit_f=True-auto-depth3]"

$(FLOOR_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install -q --upgrade pip
	$(FLOOR_VENV)/bin/python -m pip install -q "jax==$(JAX_FLOOR)" "jaxlib==$(JAX_FLOOR)" \
		pytest pytest-xdist hypothesis equinox -e .
	touch $@

test-floor: $(FLOOR_VENV)/.installed
	$(FLOOR_VENV)/bin/python -c "import jax; assert jax.__version__ == '$(JAX_FLOOR)', jax.__version__"
	$(FLOOR_VENV)/bin/python -m pytest $(PYTEST_ARGS) -p no:cacheprovider $(FLOOR_TESTS)

# Everything: the whole transform matrix (every loop x composition x strategy x checkpoints:
# 376 cases instead of the covering subset that `make test` runs) and the tests marked `slow`
# (tests/conftest.py), about 25 minutes more on two cores.
test-full: lint
	DYNDEPTH_FULL=1 $(PY) -m pytest $(PYTEST_ARGS) tests

demo: venv
	$(PY) -m dyndepth_app demo

bench: venv
	$(PY) benchmarks/bench.py

# The site, into site/; --strict: a warning (a broken link, anchor or reference) is an error.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The documentation's checks alone: the site's pages, the code in the docs and docstrings.
docs-test: docs
	$(PY) -m pytest $(PYTEST_ARGS) tests/packaging/test_site.py tests/packaging/test_docs.py

# The wheel and the sdist, into dist/, checked as the package index would.
dist: venv
	rm -rf dist
	$(PY) -m build --no-isolation --outdir dist .
	$(VENV)/bin/twine check --strict dist/*

clean:
	rm -rf $(VENV) $(FLOOR_VENV) .pytest_cache .ruff_cache site dist
