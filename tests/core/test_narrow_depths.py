"""Depths of every integer dtype against the plain-Python meaning ``min(max(depth, 0),
max_depth)``, a ``max_depth`` beyond the dtype's range included: the clamp must not cast
``max_depth`` into the depth's dtype (``uint8(300)`` is 44)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from shared_lists import STRATEGIES

import dyndepth

DTYPES = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32]


def _cases():
    """(dtype, max_depth) pairs: inside, at and past the dtype's largest value, and past it by
    the amounts that wrap to small or negative values."""
    for dtype in DTYPES:
        top = int(np.iinfo(dtype).max)
        for max_depth in sorted({3, min(top, 100), top - 1, top, top + 1, 2 * top + 46}):
            if max_depth <= 70_000:  # (each max_depth compiles a loop: keep them small)
                yield dtype, max_depth


def _depths(dtype, max_depth):
    """Depths of ``dtype``: its extremes, zero and around ``max_depth`` where representable."""
    info = np.iinfo(dtype)
    wanted = {info.min, info.max, 0, 1, 5, max_depth - 1, max_depth, max_depth + 1}
    return np.array(sorted(d for d in wanted if info.min <= d <= info.max), dtype)


def _count(c):
    return c + 1


def _plain(depths, max_depth):
    return np.minimum(np.maximum(depths.astype(np.int64), 0), max_depth).astype(np.int32)


@pytest.mark.parametrize(("dtype", "max_depth"), list(_cases()))
def test_traced_depths_of_every_dtype_run_the_plain_count(dtype, max_depth):
    depths = _depths(dtype, max_depth)
    one = jax.jit(lambda d: dyndepth.repeat(_count, jnp.int32(0), d, max_depth=max_depth))
    got = np.array([int(one(d)) for d in depths])
    np.testing.assert_array_equal(got, _plain(depths, max_depth), err_msg=f"{depths}")
    # One depth per sample (vmap) and repeat_batched clamp the same way.
    batched = jax.jit(jax.vmap(lambda d: dyndepth.repeat(_count, jnp.int32(0), d,
                                                         max_depth=max_depth)))  # fmt: skip
    np.testing.assert_array_equal(batched(depths), _plain(depths, max_depth))
    rb = jax.jit(lambda d: dyndepth.repeat_batched(
        _count, jnp.zeros(d.shape, jnp.int32), d, max_depth=max_depth))  # fmt: skip
    np.testing.assert_array_equal(rb(depths), _plain(depths, max_depth))


@pytest.mark.parametrize(("dtype", "max_depth"), [(np.uint8, 300), (np.int8, 200)])
def test_concrete_narrow_depths_below_a_wide_max_depth(dtype, max_depth):
    for d in (0, 5, 100, int(np.iinfo(dtype).max)):
        got = dyndepth.repeat(_count, jnp.int32(0), jnp.asarray(d, dtype), max_depth=max_depth)
        assert int(got) == d
        got, _ = dyndepth.scan(lambda c, x: (c + 1, None), jnp.int32(0),
                               depth=np.asarray(d, dtype), length=max_depth)  # fmt: skip
        assert int(got) == d


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_issue_repros(strategy):
    got = dyndepth.repeat(_count, jnp.int32(0), jnp.uint8(100), max_depth=300, strategy=strategy)
    assert int(got) == 100
    got = jax.jit(lambda d: dyndepth.repeat(_count, jnp.int32(0), d, max_depth=200,
                                            strategy=strategy))(jnp.int8(5))  # fmt: skip
    assert int(got) == 5
