"""``checked=True``: traced depths outside ``[0, max_depth]`` raise at run time, under jit and
vmap, with the value and its batch index, instead of being clamped."""

import jax
import jax.numpy as jnp
import pytest
from helpers import tree_allclose
from shared_lists import STRATEGIES

import dyndepth


def step(c):
    return jnp.tanh(c) + 1.0


X = jnp.linspace(-1.0, 1.0, 4)


def run(depth, checked=True):
    return dyndepth.repeat(step, X, depth, max_depth=5, checked=checked)


def test_in_range_traced_depth_runs_as_unchecked():
    f = jax.jit(run)
    for d in (0, 3, 5):
        tree_allclose(f(jnp.int32(d)), run(d, checked=False))


@pytest.mark.parametrize("bad", [7, -2])
def test_out_of_range_traced_depth_raises_under_jit(bad):
    with pytest.raises(
        Exception,
        match=rf"`depth` must lie in \[0, max_depth\] = \[0, 5\], got {bad} \(checked=True\)",
    ):
        jax.block_until_ready(jax.jit(run)(jnp.int32(bad)))
    # unchecked, the same value is clamped
    tree_allclose(jax.jit(lambda d: run(d, False))(jnp.int32(bad)), run(0 if bad < 0 else 5, False))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_vmap_reports_the_batch_index(strategy):
    def one(x, d):
        return dyndepth.repeat(step, x, d, max_depth=5, strategy=strategy, checked=True)

    xs = jnp.stack([X, X + 1, X + 2])
    f = jax.jit(jax.vmap(one))
    ok = jnp.array([1, 5, 0])
    ref = jax.vmap(lambda x, d: dyndepth.repeat(step, x, d, max_depth=5, strategy="masked"))
    tree_allclose(f(xs, ok), ref(xs, ok))
    with pytest.raises(Exception, match=r"got 9 at batch index 1 \(checked=True\)"):
        jax.block_until_ready(f(xs, jnp.array([1, 9, 2])))


def test_gradient_with_checked_depth():
    g = jax.jit(
        jax.grad(lambda x, d: jnp.sum(dyndepth.repeat(step, x, d, max_depth=5, checked=True)))
    )
    ref = jax.grad(lambda x: jnp.sum(dyndepth.repeat(step, x, 3, max_depth=5)))(X)
    tree_allclose(g(X, jnp.int32(3)), ref)
    with pytest.raises(Exception, match=r"got 6 \(checked=True\)"):
        jax.block_until_ready(g(X, jnp.int32(6)))


def test_repeat_batched_and_scan_checked():
    xs = jnp.stack([X, X + 1])
    f = jax.jit(lambda d: dyndepth.repeat_batched(step, xs, d, max_depth=5, checked=True))
    tree_allclose(
        f(jnp.array([2, 5])), dyndepth.repeat_batched(step, xs, jnp.array([2, 5]), max_depth=5)
    )
    with pytest.raises(Exception, match=r"`depths` .*got -1 at batch index 1 \(checked=True\)"):
        jax.block_until_ready(f(jnp.array([2, -1])))

    s = jax.jit(
        lambda d: dyndepth.scan(
            lambda c, x: (c + x, c), 0.0, jnp.arange(4.0), depth=d, checked=True
        )
    )
    with pytest.raises(Exception, match=r"`depth` .*got 5 \(checked=True\)"):
        jax.block_until_ready(s(jnp.int32(5)))
