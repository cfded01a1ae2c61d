"""Lockstep masks of narrow rows (``dyndepth._leaves.RowsBelow``): the mask a lockstep loop
compares with the lengths broadcast before the loop is the broadcast mask, and loops over
leaves of every row shape, narrow and wide side by side, match the plain-Python loop."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import reference_scan, tree_allclose

import dyndepth as dd
from dyndepth._leaves import NARROW, RowsBelow, rows_mask, wide_bounds

B, T = 5, 4
# per-row shapes: none, one element, narrow (2 to NARROW elements), wide (more)
ROW_SHAPES = [(), (1,), (2,), (2, 3), (NARROW,), (NARROW + 1,), (3, 4)]


@pytest.mark.parametrize("i", [0, 2, 7])
def test_the_hoisted_mask_is_the_broadcast_mask(i):
    bound = jnp.array([0, 3, 7, 2, 9], jnp.int32)
    leaves = [jnp.ones((B,) + shape) for shape in ROW_SHAPES]
    below = RowsBelow(jnp.int32(i), bound, wide_bounds(bound, leaves))
    narrow = {x.shape for x in leaves if 1 < x[0].size <= NARROW}
    assert set(below.wide) == narrow
    plain = jnp.int32(i) < bound
    for x in leaves:
        got = jnp.broadcast_to(rows_mask(below, x), x.shape)
        np.testing.assert_array_equal(got, jnp.broadcast_to(rows_mask(plain, x), x.shape))
    np.testing.assert_array_equal(below & (bound > 2), plain & (bound > 2))
    np.testing.assert_array_equal((bound > 2) & below, plain & (bound > 2))
    np.testing.assert_array_equal(~below, ~plain)
    assert below.shape == (B,)


def test_no_wide_bound_for_other_row_counts_or_rows_of_one_element():
    bound = jnp.arange(B, dtype=jnp.int32)
    leaves = [jnp.ones((B + 1, 2)), jax.random.split(jax.random.key(0), B), jnp.ones((B,))]
    assert wide_bounds(bound, leaves) == {}


def step(W, V):
    def f(c, x):
        h = jnp.tanh(c["h"] @ W + x["a"].sum())
        new = {
            "h": h,
            "n": c["n"] + 1,
            "p": c["p"] * 0.9 + jnp.sum(h) * x["a"],
            "q": c["q"] + 0.1 * jnp.tanh(c["q"] @ V),
            "s": c["s"] + jnp.mean(h),
        }
        return new, {"y2": h[:2] * x["a"][0], "y9": jnp.tile(h, 3)[:9]}

    return f


def init_of(key):
    k = jax.random.split(key, 4)
    return {
        "h": jax.random.normal(k[0], (B, 3)),  # narrow
        "n": jnp.zeros((B,), jnp.int32),  # one element
        "p": jax.random.normal(k[1], (B, 2)),  # narrow
        "q": jax.random.normal(k[2], (B, 3, 4)),  # wide
        "s": jax.random.normal(k[3], (B, 1)),  # one element
    }


def loss_of(run):
    def loss(W, V, init, xs):
        c, ys = run(W, V, init, xs)
        return sum(jnp.sum(jnp.sin(leaf)) for leaf in jax.tree_util.tree_leaves((c, ys))
                   if jnp.issubdtype(leaf.dtype, jnp.floating))  # fmt: skip

    return loss


@pytest.mark.parametrize(
    "slots,checkpoints,seed", list(itertools.product([B, 2], [None, 2], [0, 1]))
)
def test_loops_over_narrow_and_wide_rows_match_the_plain_loop(slots, checkpoints, seed):
    kw, kv, ki, kx, kd = jax.random.split(jax.random.PRNGKey(seed), 5)
    W = jax.random.normal(kw, (3, 3)) * 0.5
    V = jax.random.normal(kv, (4, 4)) * 0.5
    init = init_of(ki)
    xs = {"a": jax.random.normal(kx, (B, T, 2))}
    depths = jax.random.randint(kd, (B,), 0, T + 1).at[0].set(T).at[1].set(0)

    def run(W, V, init, xs):
        def one(c, x, d):
            return dd.scan(step(W, V), c, x, depth=d, slots=slots, checkpoints=checkpoints)

        return jax.vmap(one)(init, xs, depths)

    def reference(W, V, init, xs):
        outs = []
        for b in range(B):
            row = jax.tree_util.tree_map(lambda a, b=b: a[b], (init, xs))
            outs.append(reference_scan(step(W, V), *row, int(depths[b]), T))
        return jax.tree_util.tree_map(lambda *r: jnp.stack(r), *outs)

    tree_allclose(jax.jit(run)(W, V, init, xs), reference(W, V, init, xs), rtol=1e-5, atol=1e-6)
    got = jax.jit(jax.grad(loss_of(run), argnums=(0, 1, 2, 3), allow_int=True))(W, V, init, xs)
    want = jax.grad(loss_of(reference), argnums=(0, 1, 2, 3), allow_int=True)(W, V, init, xs)
    tree_allclose(_floats(got), _floats(want), rtol=1e-4, atol=1e-5)


def _floats(tree) -> list:
    return [x for x in jax.tree_util.tree_leaves(tree) if x.dtype != jax.dtypes.float0]
