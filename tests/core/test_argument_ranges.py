"""Arguments out of range fail at the call with a message naming the argument (issue 40, third
hostile pass): a ``repeat_batched`` depth beyond int32 (was numpy's OverflowError, naming
neither ``depths`` nor its range) and ``set_iteration_cost`` with NaN or infinite costs or an
unknown platform (was accepted; every later loop then failed far from the call)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dyndepth as dd
from dyndepth import _cost


def step(c):
    return c + 1.0


@pytest.mark.parametrize(
    ("depths", "shown"),
    [
        (2**31, "2147483648"),
        (2**40, "1099511627776"),
        (2**70, str(2**70)),
        (np.int64(2**40), "1099511627776"),
        (-(2**63) - 1, str(-(2**63) - 1)),
        ([1, 2**31], "2147483648 at batch index 1"),
        ((0, 2**70, 1), f"{2**70} at batch index 1"),
    ],
)
def test_repeat_batched_python_depths_beyond_int32(depths, shown):
    with pytest.raises(ValueError, match=rf"`depths` must lie in \[0, max_depth\] = \[0, 5\], "
                                         rf"got {shown}"):  # fmt: skip
        dd.repeat_batched(step, jnp.zeros((2,)), depths, max_depth=5)


def test_repeat_batched_python_depths_in_range_still_run():
    out = dd.repeat_batched(step, jnp.zeros((3,)), [0, 5, 2], max_depth=5)
    np.testing.assert_array_equal(out, [0.0, 5.0, 2.0])
    np.testing.assert_array_equal(dd.repeat_batched(step, jnp.zeros((2,)), 4, max_depth=5), [4, 4])


@pytest.fixture
def restore_cpu_cost():
    saved = _cost.backend_cost("cpu")
    yield
    dd.set_iteration_cost("cpu", saved)


GOOD = dd.IterationCost(fixed_seconds=1e-6, flops_per_second=1e9, row_floor_seconds=1e-9)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("fixed_seconds", math.nan, ValueError),
        ("fixed_seconds", math.inf, ValueError),
        ("fixed_seconds", -1.0, ValueError),
        ("row_floor_seconds", math.nan, ValueError),
        ("row_floor_seconds", math.inf, ValueError),
        ("flops_per_second", math.nan, ValueError),
        ("flops_per_second", 0.0, ValueError),
        ("flops_per_second", -math.inf, ValueError),
        ("bytes_per_second", math.nan, ValueError),
        ("bytes_per_second", -1.0, ValueError),
        ("fixed_seconds", "1e-6", TypeError),
        ("flops_per_second", None, TypeError),
    ],
)
def test_set_iteration_cost_refuses_bad_costs(restore_cpu_cost, field, value, error):
    before = _cost.backend_cost("cpu")
    with pytest.raises(error, match=rf"`cost\.{field}` must be"):
        dd.set_iteration_cost("cpu", dataclasses.replace(GOOD, **{field: value}))
    assert _cost.backend_cost("cpu") is before  # nothing was set


def test_set_iteration_cost_accepts_infinite_rates(restore_cpu_cost):
    free = dataclasses.replace(GOOD, flops_per_second=math.inf, bytes_per_second=math.inf)
    dd.set_iteration_cost("cpu", free)
    assert _cost.backend_cost("cpu") == free
    depths = jnp.array([1, 3, 0, 2], jnp.int32)
    out = jax.jit(jax.vmap(lambda x, d: dd.repeat(step, x, d, max_depth=3)))(jnp.zeros(4), depths)
    np.testing.assert_array_equal(out, depths.astype(jnp.float32))


@pytest.mark.parametrize("platform", ["cpuu", "CPU", "", None, 0])
def test_set_iteration_cost_refuses_unknown_platforms(restore_cpu_cost, platform):
    with pytest.raises(ValueError, match=r"`platform` must be one of \[.*'cpu'.*\], got"):
        dd.set_iteration_cost(platform, GOOD)
    with pytest.raises(ValueError, match=r"`platform` must be one of"):
        dd.set_iteration_cost(platform, None)
