"""``with_index=True``: the step gets its index, ``f(i, carry[, x][, key])``, in every loop and
``nn.recurrent_depth``, under the transform matrix's transformations and strategies, against plain
Python loops that pass the index by hand (and the documented key schedule, unchanged).

The step's output depends on the index (``cos(i)``), so an index off by one, shared by the batch,
or counted in the scheduler's slot instead of the sample's own step shows as a mismatch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from helpers import tree_allclose
from shared_lists import cfg_id, covering
from test_transform_matrix import (
    CONFIGS,
    DEPTH_SETS,
    DEPTHS,
    FORWARD,
    KEYS,
    MAX,
    PARAMS,
    REVERSE,
    REVERSE_CONFIGS,
    SEQ,
    TOL,
    X,
    depth_set,
    depths_of,
    python_vmap,
)

import dyndepth as dd


def fold(key, i):
    return jax.random.fold_in(key, i)


def layer(p, i, c, k):
    """A step whose output depends on its index ``i`` and its key."""
    i = jnp.asarray(i, jnp.float32)
    return (
        jnp.tanh(c @ p["W"] + p["b"]) * jnp.cos(i) + 0.1 * jax.random.normal(k, c.shape) + 0.01 * i
    )


def repeat_case(strategy, ckpt):
    def fn(p, x, d, k):
        return dd.repeat(lambda i, c, kk: layer(p, i, c, kk), x, d, max_depth=MAX, key=k,
                         strategy=strategy, checkpoints=ckpt, with_index=True)  # fmt: skip

    def ref(p, x, d, k):
        for i in range(int(d)):
            x = layer(p, i, x, fold(k, i))
        return x

    return fn, ref


def scan_case(strategy, ckpt):
    def body(p, i, c, s, k):
        c = layer(p, i, c, k) * s
        return c, jnp.sum(c * s) + jnp.asarray(i, jnp.float32)

    def fn(p, x, d, k, seq):
        return dd.scan(lambda i, c, s, kk: body(p, i, c, s, kk), x, seq, depth=d, key=k,
                       strategy=strategy, checkpoints=ckpt, with_index=True)  # fmt: skip

    def ref(p, x, d, k, seq):
        ys = []
        for i in range(MAX):
            if i < int(d):
                x, y = body(p, i, x, seq[i], fold(k, i))
            else:
                y = jnp.zeros((), jnp.float32)
            ys.append(y)
        return x, jnp.stack(ys)

    return fn, ref


def while_case(strategy, ckpt):
    # The stop rule reads the carry (its own counter) and a per-sample depth it closes over.
    def cond(d):
        return lambda s: (s[1] < d) & (jnp.max(jnp.abs(s[0])) < 50.0)

    def body(p):
        return lambda i, s, kk: (layer(p, i, s[0], kk), s[1] + 1)

    def fn(p, x, d, k):
        return dd.while_loop(cond(d), body(p), (x, jnp.int32(0)), max_steps=MAX, key=k,
                             strategy=strategy, checkpoints=ckpt, with_index=True)[0]  # fmt: skip

    def ref(p, x, d, k):
        s, i = (x, jnp.int32(0)), 0
        while i < MAX and bool(cond(int(d))(s)):
            s = body(p)(i, s, fold(k, i))
            i += 1
        return s[0]

    return fn, ref


def recurrent_case(strategy, ckpt):
    def core(p, j, s, x, kk):
        return layer(p, j, s + x, kk)

    def fn(p, x, d, k):
        n, kd = d // 2, d - d // 2
        return dd.nn.recurrent_depth(lambda j, s, xx, kk: core(p, j, s, xx, kk), x, x, n=n,
                                     k=kd, max_n=MAX // 2, max_k=MAX - MAX // 2, key=k,
                                     strategy=strategy, checkpoints=ckpt,
                                     with_index=True)  # fmt: skip

    def ref(p, x, d, k):
        d = int(d)
        n, kd = d // 2, d - d // 2
        s, stop = x, jax.lax.stop_gradient
        for j in range(n):
            s = core(stop(p), j, s, stop(x), fold(k, j))
        if n:
            s = stop(s)
        for j in range(kd):
            s = core(p, n + j, s, x, fold(k, n + j))
        return s

    return fn, ref


CASES = {
    "repeat": repeat_case,
    "scan": scan_case,
    "while_loop": while_case,
    "recurrent_depth": recurrent_case,
}


def sample_args(case, depths=DEPTHS):
    return (X, depths, KEYS, SEQ) if case == "scan" else (X, depths, KEYS)


@functools.cache
def expected(case, transform, depths="all"):
    _, ref = CASES[case]("masked", None)
    return transform(python_vmap, ref, PARAMS, sample_args(case, DEPTH_SETS[depths]))


# Every case under every transform once, the configuration turning (as the matrix's covering
# subset); all of them with ``DYNDEPTH_FULL=1``.
TRIPLES = [(c, n, k, REVERSE)
           for c, n, k in covering(list(CASES), list(REVERSE), REVERSE_CONFIGS)]  # fmt: skip
TRIPLES += [(c, n, k, FORWARD) for c, n, k in covering(list(CASES), list(FORWARD), CONFIGS)]


@pytest.mark.parametrize(
    ("case", "name", "cfg", "table"),
    TRIPLES,
    ids=[f"{c}-{n}-{cfg_id(k)}" for c, n, k, _ in TRIPLES],
)
def test_step_index_matrix(case, name, cfg, table):
    fn, _ = CASES[case](*cfg[:2])
    transform = table[name]
    args = sample_args(case, depths_of(cfg))
    got = jax.jit(lambda p, *a: transform(jax.vmap, fn, p, a))(PARAMS, *args)
    want = expected(case, transform, depth_set(cfg))
    tree_allclose(got, want, **TOL, err_msg=f"{case} {cfg_id(cfg)} {name}")


@pytest.mark.parametrize("slots", [None, 1, 2, 4])
def test_repeat_batched_index_is_each_samples_own_step(slots):
    """The per-sample scheduler runs a sample's steps in whichever slot and iteration it is
    given (wrapped around between slots): its index is still its own step number. Values and
    gradients against the plain loop over the batch."""
    depths = jnp.array([3, 0, 4, 1, 4, 2, 0, 3], jnp.int32)
    xs = jax.random.normal(jax.random.PRNGKey(7), (8, X.shape[1]))
    keys = jax.random.split(jax.random.PRNGKey(8), 8)

    def run(p):
        f = lambda i, c, k: layer(p, i, c, k)  # noqa: E731
        return dd.repeat_batched(f, xs, depths, max_depth=MAX, keys=keys, slots=slots,
                                 with_index=True)  # fmt: skip

    def ref(p):
        rows = []
        for b in range(8):
            c = xs[b]
            for i in range(int(depths[b])):
                c = layer(p, i, c, fold(keys[b], i))
            rows.append(c)
        return jnp.stack(rows)

    loss = lambda run: lambda p: jnp.sum(jnp.sin(run(p)))  # noqa: E731
    tree_allclose(jax.jit(run)(PARAMS), ref(PARAMS), **TOL)
    tree_allclose(jax.jit(jax.grad(loss(run)))(PARAMS), jax.grad(loss(ref))(PARAMS), **TOL)


def test_same_keys_with_and_without_the_index():
    """The key schedule does not move: a step that ignores its index gives what the loop
    without ``with_index`` gives, bit for bit."""
    f = lambda c, k: jnp.tanh(c) + jax.random.normal(k, c.shape)  # noqa: E731
    key = jax.random.PRNGKey(3)
    plain = dd.repeat(f, X[0], 3, max_depth=MAX, key=key)
    indexed = dd.repeat(lambda i, c, k: f(c, k), X[0], 3, max_depth=MAX, key=key, with_index=True)
    tree_allclose(indexed, plain, rtol=0, atol=0)


def test_with_index_must_be_a_bool():
    with pytest.raises(TypeError, match="with_index"):
        dd.repeat(lambda i, c: c, X[0], 1, max_depth=MAX, with_index="yes")
