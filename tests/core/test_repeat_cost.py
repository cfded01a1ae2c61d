"""What ``dyndepth.repeat`` costs: no recompilation for new depths, and the step's evaluations,
counted by a callback, following the depth forward and under ``value_and_grad``; residuals over
the budget recomputed instead of stored."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import Counter, tree_allclose
from loop_setup import GTOL, KEYS, MAX, W0, X0, XB, B, D, ref, ref_batch, run
from shared_lists import STRATEGIES

import dyndepth as dd

# ----------------------------------------------------------------------------- cost and compilation


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_recompile_for_new_depths(strategy):
    traces = {"shared": 0, "batched": 0}

    @jax.jit
    def shared(x, d):
        traces["shared"] += 1
        return run("tanh", W0, x, d, None, strategy)

    @jax.jit
    def batched(X, depths):
        traces["batched"] += 1
        return jax.vmap(lambda x, d: run("tanh", W0, x, d, None, strategy))(X, depths)

    for d in (0, 2, MAX, 1):
        tree_allclose(shared(X0, jnp.int32(d)), ref("tanh", W0, X0, d, None))
    for depths in ([0, 1, 2, 3], [MAX] * B, [0] * B, [4, 0, 4, 1]):
        depths = jnp.array(depths, jnp.int32)
        tree_allclose(batched(XB, depths), ref_batch("tanh", W0, XB, depths, KEYS))
    assert traces == {"shared": 1, "batched": 1}


def counted_layer(counter, W=W0):
    def f(x):
        counter.tick()
        return x + jnp.tanh(W @ x)

    return f


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_forward_evaluations_follow_depth(strategy):
    """Unbatched, without a gradient: every strategy evaluates the body exactly ``depth`` times
    (``masked``'s ``lax.cond`` really skips when its predicate is unbatched)."""
    counter = Counter()
    fn = jax.jit(
        lambda x, d: dd.repeat(counted_layer(counter), x, d, max_depth=MAX, strategy=strategy)
    )
    for d in (0, 1, 3, MAX):
        assert counter.run(fn, X0, jnp.int32(d)) == d, f"depth={d}"


@pytest.mark.parametrize("strategy", ["masked", "while", "checkpointed"])
def test_forward_evaluations_under_vmap(strategy):
    """Per-sample depths: ``masked`` runs all ``max_depth`` steps (its cond becomes a select);
    the loop strategies run until the deepest sample is done."""
    counter = Counter()
    fn = jax.jit(
        jax.vmap(
            lambda x, d: dd.repeat(counted_layer(counter), x, d, max_depth=MAX, strategy=strategy)
        )
    )
    depths = jnp.array([0, 1, 3, 2], jnp.int32)
    expected = MAX if strategy == "masked" else 3
    assert counter.run(fn, XB, depths) == expected


@pytest.mark.parametrize("strategy,ckpt", [("checkpointed", k) for k in (None, 1, 2, 3, 6)])
def test_gradient_evaluations_follow_depth(strategy, ckpt):
    """jit(value_and_grad), unbatched: ``depth`` body evaluations when every step's residuals
    are stored (``checkpoints=None`` or ``K >= max_depth``: no recomputation), ``2 * depth``
    with a checkpoint at every step taken (``depth <= K < max_depth``), at most ``3 * depth``
    with ``K < depth``."""
    max_depth = 6
    counter = Counter()

    def loss(x, d):
        out = dd.repeat(
            counted_layer(counter), x, d, max_depth=max_depth, strategy=strategy, checkpoints=ckpt
        )
        return jnp.sum(out**2)

    vg = jax.jit(jax.value_and_grad(loss))
    for d in (0, 1, 2, 3, 6):
        n = counter.run(vg, X0, jnp.int32(d))
        if ckpt is None or ckpt >= max_depth:
            assert n == d, f"depth={d}: {n} evaluations"
        elif ckpt >= d:
            assert n == 2 * d, f"depth={d}: {n} evaluations"
        else:
            assert 2 * d <= n <= 3 * d, f"depth={d}: {n} evaluations"
        # The gradient is still right.
        g = vg(X0, jnp.int32(d))[1]
        tree_allclose(
            g, jax.grad(lambda x, d=d: jnp.sum(ref("tanh", W0, x, d, None) ** 2))(X0), **GTOL
        )


def test_auto_evaluations_unbatched_and_vmapped():
    """``"auto"``: ``depth`` evaluations without a gradient; with one, unbatched, still
    ``depth`` (the forward pass stores each step's residuals); under vmap ``2 * depth`` (the
    carries are stored and each step is recomputed once)."""
    counter = Counter()

    def out(x, d):
        return dd.repeat(counted_layer(counter), x, d, max_depth=MAX, strategy="auto")

    fwd = jax.jit(out)
    vg = jax.jit(jax.value_and_grad(lambda x, d: jnp.sum(out(x, d))))
    vg_b = jax.jit(jax.value_and_grad(lambda x, d: jnp.sum(jax.vmap(out, (0, None))(x, d))))
    for d in (0, 2, MAX):
        assert counter.run(fwd, X0, jnp.int32(d)) == d
        assert counter.run(vg, X0, jnp.int32(d)) == d
        assert counter.run(vg_b, XB, jnp.int32(d)) == 2 * d


def _wide(counter):
    """A step whose residuals (a 64-wide hidden layer, twice) exceed the stored-residual budget
    of 4x the carry (3 floats)."""
    W1 = jax.random.normal(jax.random.PRNGKey(3), (64, D)) / 2
    W2 = jax.random.normal(jax.random.PRNGKey(4), (D, 64)) / 8

    def f(x):
        counter.tick()
        return x + W2 @ jnp.tanh(W1 @ x)

    return f


def test_large_residuals_are_recomputed_instead_of_stored():
    counter = Counter()
    f = _wide(counter)

    def loss(x, d):
        return jnp.sum(dd.repeat(f, x, d, max_depth=MAX, strategy="auto") ** 2)

    vg = jax.jit(jax.value_and_grad(loss))
    assert counter.run(vg, X0, jnp.int32(3)) == 6

    def reference(x, d):
        for _ in range(d):
            x = f(x)
        return jnp.sum(x**2)

    tree_allclose(vg(X0, jnp.int32(3))[1], jax.grad(reference)(X0, 3), **GTOL)


@pytest.mark.parametrize("wide", [False, True])
def test_jacrev_and_vmap_of_vjp_match_the_reference(wide):
    """jacrev (vmap of the pullback over cotangents, the forward pass unbatched) through both
    backward paths: stored residuals, and stored carries."""
    f = _wide(Counter()) if wide else (lambda x: x + jnp.tanh(W0 @ x))

    def reference(x, d):
        for _ in range(d):
            x = f(x)
        return x

    def fn(x, d):
        return dd.repeat(f, x, d, max_depth=MAX, strategy="auto")

    for d in (0, 1, 3):
        tree_allclose(
            jax.jit(jax.jacrev(fn))(X0, jnp.int32(d)), jax.jacrev(reference)(X0, d), **GTOL
        )
