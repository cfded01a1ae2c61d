"""Tests for the per-step key schedule: ``step_key(key, i) == jax.random.fold_in(key, i)``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import expect_errors, reference_repeat, tree_allclose, tree_equal
from shared_lists import STRATEGIES

import dyndepth as dd

D = 3
B = 4
MAX = 5
W0 = jax.random.normal(jax.random.PRNGKey(20), (D, D)) * 0.5
XB = jax.random.normal(jax.random.PRNGKey(21), (B, D))
DEPTHS = jnp.array([0, 2, MAX, 3], jnp.int32)

KEY_KINDS = {
    "typed": lambda seed: jax.random.key(seed),
    "raw": lambda seed: jax.random.PRNGKey(seed),
}


def data(k):
    """uint32 key data of a typed key, or the raw key itself."""
    if jnp.issubdtype(k.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(k)
    return k


@pytest.mark.parametrize("kind", list(KEY_KINDS))
def test_step_key_is_fold_in(kind):
    key = KEY_KINDS[kind](7)
    for i in range(6):
        got = dd.step_key(key, i)
        assert got.dtype == key.dtype and got.shape == key.shape
        tree_equal(got, jax.random.fold_in(key, i), err_msg=f"i={i}")
    # Different steps get different keys.
    assert len({tuple(np.asarray(data(dd.step_key(key, i))).tolist()) for i in range(6)}) == 6
    # Traced index, under jit; vmapped over the index and over keys.
    tree_equal(jax.jit(dd.step_key)(key, jnp.int32(3)), jax.random.fold_in(key, 3))
    idx = jnp.arange(4, dtype=jnp.int32)
    tree_equal(
        jax.vmap(dd.step_key, in_axes=(None, 0))(key, idx),
        jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, idx),
    )
    keys = jax.random.split(key, 3)
    tree_equal(
        jax.vmap(dd.step_key, in_axes=(0, None))(keys, 2),
        jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, 2),
    )


NON_KEYS = {
    "float-array": ((jnp.zeros(2),), TypeError, r"got dtype float32 and shape \(2,\)"),
    "uint32-wrong-shape": (
        (jnp.zeros(3, jnp.uint32),),
        TypeError,
        r"dtype uint32 and shape \(3,\)",
    ),
    "int32-pair": ((jnp.zeros(2, jnp.int32),), TypeError, r"got dtype int32"),
    "python-int": ((5,), TypeError, r"jax.random.key or jax.random.PRNGKey, got int"),
    "typed-key-batch": (
        (jax.random.split(jax.random.key(0), 2),),
        TypeError,
        r"single PRNG key \(shape \(\)\)",
    ),
}


def test_step_key_rejects_non_keys():
    expect_errors(NON_KEYS, list(NON_KEYS), lambda args: dd.step_key(args[0], 0))


@pytest.mark.parametrize("kind", list(KEY_KINDS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_keys_seen_by_repeat(strategy, kind):
    """``f`` writes the key it receives into its carry: step ``i`` sees ``step_key(key, i)``."""
    key = KEY_KINDS[kind](3)

    def f(c, k):
        i, seen = c
        return i + 1, seen.at[i].set(data(k))

    init = (jnp.int32(0), jnp.zeros((MAX, 2), jnp.uint32))
    fn = jax.jit(lambda d, k: dd.repeat(f, init, d, max_depth=MAX, key=k, strategy=strategy))
    for d in (0, 3, MAX):
        n, seen = fn(jnp.int32(d), key)
        assert int(n) == d
        expected = [np.asarray(data(dd.step_key(key, i))) for i in range(d)]
        expected += [np.zeros(2, np.uint32)] * (MAX - d)
        np.testing.assert_array_equal(np.asarray(seen), np.stack(expected), err_msg=f"depth={d}")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_keys_seen_by_scan_and_while_loop(strategy):
    key = jax.random.key(11)
    length = 4

    def f(c, x, k):
        return c + 1, jax.random.key_data(k)

    _, ys = dd.scan(f, jnp.int32(0), None, depth=3, length=length, key=key, strategy=strategy)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(ys[i]), np.asarray(data(dd.step_key(key, i))))
    np.testing.assert_array_equal(np.asarray(ys[3]), 0)

    def body(c, k):
        i, seen = c
        return i + 1, seen.at[i].set(jax.random.key_data(k))

    (n, seen), steps = dd.while_loop(
        lambda c: c[0] < 2,
        body,
        (jnp.int32(0), jnp.zeros((length, 2), jnp.uint32)),
        max_steps=length,
        key=key,
        strategy=strategy,
        return_steps=True,
    )
    assert int(steps) == 2 == int(n)
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(seen[i]), np.asarray(data(dd.step_key(key, i))))
    np.testing.assert_array_equal(np.asarray(seen[2:]), 0)


def noisy_layer(W):
    def f(x, k):
        return x + jnp.tanh(W @ x) * jax.random.normal(k, x.shape)

    return f


def test_key_schedule_independent_of_max_depth_strategy_and_batch():
    """A sample that runs d steps sees the same keys whatever max_depth, strategy or batch."""
    key = jax.random.key(5)
    x = XB[1]
    expected = reference_repeat(noisy_layer(W0), x, 3, key=key)
    configs = [(3, "auto"), (8, "auto")] + [(6, s) for s in STRATEGIES if s != "auto"]
    for max_depth, strategy in configs:
        out = dd.repeat(noisy_layer(W0), x, 3, max_depth=max_depth, key=key, strategy=strategy)
        tree_allclose(out, expected, err_msg=f"max_depth={max_depth}, {strategy}")
    # The same sample inside a batch with other depths and keys.
    keys = jax.random.split(jax.random.key(9), B).at[1].set(key)
    depths = jnp.array([5, 3, 0, 1], jnp.int32)
    out = jax.vmap(lambda x, d, k: dd.repeat(noisy_layer(W0), x, d, max_depth=8, key=k))(
        XB, depths, keys
    )
    tree_allclose(out[1], expected, err_msg="in a batch")
    # And the key matters: another key gives another result.
    other = dd.repeat(noisy_layer(W0), x, 3, max_depth=MAX, key=jax.random.key(6))
    assert not np.allclose(np.asarray(other), np.asarray(expected))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_typed_keys_under_vmap(strategy):
    keys = jax.random.split(jax.random.key(0), B)

    def run(X, W):
        return jax.vmap(
            lambda x, d, k: dd.repeat(noisy_layer(W), x, d, max_depth=MAX, key=k, strategy=strategy)
        )(X, DEPTHS, keys)

    def ref(X, W):
        return jnp.stack(
            [reference_repeat(noisy_layer(W), X[b], int(DEPTHS[b]), key=keys[b]) for b in range(B)]
        )

    tree_allclose(jax.jit(run)(XB, W0), ref(XB, W0))
    if strategy != "while":

        def loss(fn):
            return lambda X, W: jnp.sum(fn(X, W) ** 2)

        tree_allclose(
            jax.jit(jax.grad(loss(run), argnums=(0, 1)))(XB, W0),
            jax.grad(loss(ref), argnums=(0, 1))(XB, W0),
            rtol=1e-5,
            atol=1e-4,
        )


def test_raw_and_typed_keys_give_the_same_stream():
    """``jax.random.key(s)`` and ``jax.random.PRNGKey(s)`` hold the same bits, so the loop draws
    the same numbers from either."""
    x = XB[2]
    typed = dd.repeat(noisy_layer(W0), x, 4, max_depth=MAX, key=jax.random.key(4))
    raw = dd.repeat(noisy_layer(W0), x, 4, max_depth=MAX, key=jax.random.PRNGKey(4))
    tree_equal(typed, raw)
