"""Test configuration: strict dtype promotion, float32 (x64 stays off), helpers on the path.

It applies to every folder below it (core, nn, app, multi_device, packaging)."""

from __future__ import annotations

import importlib.metadata
import os
import sys

# ``make test`` compiles with XLA's CPU backend at optimization level 0 (LLVM's optimizations
# off; XLA's own passes, which decide the loops, conditionals and collectives the tests inspect,
# still run) and with its older fusion emitters, which compiled the tests' programs in about 40%
# less time than the MLIR ones (tests/core/test_second_order_forms.py: 84 s against 132 s on
# two cores): the tests check values and compiled programs, not speed, and most of their time
# is compiling. Set before JAX starts its backend; child processes inherit it. ``make
# test-full`` compiles as users do.
FULL = os.environ.get("DYNDEPTH_FULL") == "1"


def _jaxlib_major_minor() -> tuple[int, int]:
    major, minor = importlib.metadata.version("jaxlib").split(".")[:2]
    return int(major), int(minor)


if not FULL:
    xla_flags = [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]
    # An XLA that does not know a flag aborts at start: the emitters' flag goes only to the
    # jaxlib releases it was checked on (0.9.2, the floor, to 0.10.2).
    if _jaxlib_major_minor() < (0, 11):
        xla_flags.append("--xla_cpu_use_fusion_emitters=false")
    os.environ["XLA_FLAGS"] = " ".join(xla_flags).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

import dyndepth as dd  # noqa: E402
from dyndepth import _cost  # noqa: E402

# Strict promotion at import, before any test module builds an array: Python scalars mixed with
# arrays stay fine (weak types), but float32 mixed with int32 arrays is an error, so a loop that
# silently promotes a leaf fails loudly here.
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_enable_x64", False)

# ``from helpers import ...`` works from every folder under every pytest import mode: this
# folder, the tests' root, is on the path (pytest's default mode adds each test file's own folder).
sys.path.insert(0, os.path.dirname(__file__))


# The scheduler's time model on this CPU makes an iteration's fixed cost worth hundreds of rows of
# the tests' tiny steps, so by default their small batches would run in lockstep and the
# per-sample scheduler would go untested. The tests price an iteration at one row: the time rule
# then chooses among every slot count of its ladder as on a large step
# (tests/core/test_schedule.py checks the measured defaults apart).
TEST_COST = dd.IterationCost(fixed_seconds=1e-9, flops_per_second=1e30, row_floor_seconds=1e-9)
dd.set_iteration_cost("cpu", TEST_COST)


@pytest.fixture
def trace_kernels_for(monkeypatch):
    """``trace_kernels_for(platform)``: until the test ends, the loops' kernels are traced as for
    ``platform`` (its decisions, such as a TPU's chain of the slot counts' loops where a CPU or
    a GPU chooses among them under one conditional), under the tests' iteration cost; they still
    run on this CPU."""

    def trace_for(platform: str) -> None:
        if platform != jax.default_backend():
            monkeypatch.setattr(_cost, "current_platform", lambda: platform)
            monkeypatch.setitem(_cost.BACKEND_COSTS, platform, TEST_COST)

    return trace_for


@pytest.fixture(scope="session", autouse=True)
def _strict_float32_session():
    """Keep the whole session on strict promotion and float32, and say so if a test changes it."""
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_enable_x64", False)
    yield
    assert jax.config.jax_numpy_dtype_promotion == "strict"
    assert not jax.config.jax_enable_x64


# ``make test`` skips the tests marked ``slow`` (a second, larger run of what faster tests
# already check: end-to-end training runs, larger workloads, more property examples) and the
# cross-products beyond their covering subsets (``shared_lists.covering``) to stay short on two
# cores; ``make test-full`` (``DYNDEPTH_FULL=1``) runs them.


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: runs in `make test-full` only (DYNDEPTH_FULL=1)")


def pytest_collection_modifyitems(config, items):
    if FULL:
        return
    skip = pytest.mark.skip(reason="slow: runs in `make test-full` (DYNDEPTH_FULL=1)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
