"""Tests for ``dyndepth.nn.recurrent_depth``: truncated backprop, keys, progressive outputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import dyndepth_loops, tree_allclose

import dyndepth
import dyndepth.nn as dnn

D = 4
W = jax.random.normal(jax.random.PRNGKey(0), (D, D)) / np.sqrt(D)
X = jax.random.normal(jax.random.PRNGKey(1), (D,))
S0 = jax.random.normal(jax.random.PRNGKey(2), (D,)) * 0.1
KEY = jax.random.PRNGKey(3)
GTOL = dict(rtol=1e-5, atol=1e-5)


def core_of(W):
    """A recall core with a dropout-like use of the step key."""

    def core(s, x, key):
        noise = jax.random.uniform(key, (D,), minval=0.9, maxval=1.1)
        return jnp.tanh(W @ s + x) * noise

    return core


def reference(W, x, s, n, k, key, readout=None):
    """The docstring's loop, eagerly: ``n`` steps, stop_gradient, ``k`` steps."""
    core = core_of(W)
    for j in range(n):
        s = core(s, x, jax.random.fold_in(key, j))
    if n > 0:
        s = jax.lax.stop_gradient(s)
    ys = []
    for j in range(n, n + k):
        s = core(s, x, jax.random.fold_in(key, j))
        ys.append(s if readout is None else readout(s))
    return s, ys


def loss_of(out):
    return jnp.sum(jnp.sin(out) ** 2)


@pytest.mark.parametrize("strategy", ["auto", "masked"])
def test_value_and_gradient_match_truncated_reference(strategy):
    def fast(W, x, s, n, k):
        out = dnn.recurrent_depth(
            core_of(W), s, x, n=n, k=k, max_n=12, max_k=8, key=KEY, strategy=strategy
        )
        return loss_of(out)

    vg = jax.jit(jax.value_and_grad(fast, argnums=(0, 1, 2)))
    for n, k in [(5, 8), (12, 8), (0, 3), (4, 0), (0, 0)]:
        ref = jax.value_and_grad(
            lambda W, x, s, n=n, k=k: loss_of(reference(W, x, s, n, k, KEY)[0]), argnums=(0, 1, 2)
        )(W, X, S0)
        tree_allclose(vg(W, X, S0, n, k), ref, **GTOL, err_msg=f"n={n}, k={k}")


@pytest.mark.parametrize("slots", [None, 1, 3, (4, 2)])
def test_per_sample_counts_and_keys_under_vmap(slots):
    B = 4
    ns = jnp.array([0, 3, 10, 7], jnp.int32)
    ks = jnp.array([1, 8, 2, 0], jnp.int32)
    xs = jax.random.normal(jax.random.PRNGKey(4), (B, D))
    keys = jax.random.split(jax.random.PRNGKey(5), B)

    def loss(W, xs, ns, ks):  # (the counts as arguments: XLA keeps the run-time choice)
        out = jax.vmap(
            lambda x, n, k, key: dnn.recurrent_depth(
                core_of(W), S0, x, n=n, k=k, max_n=10, max_k=8, key=key, slots=slots
            )
        )(xs, ns, ks, keys)
        return jnp.sum(jax.vmap(loss_of)(out))

    def ref_loss(W, xs):
        return sum(
            loss_of(reference(W, xs[b], S0, int(ns[b]), int(ks[b]), keys[b])[0]) for b in range(B)
        )

    vg = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    want = jax.value_and_grad(ref_loss, argnums=(0, 1))(W, xs)
    tree_allclose(vg(W, xs, ns, ks), want, **GTOL)
    # A loop per slot count per scheduled loop (the detached phase forward, the differentiated
    # one forward and backward), one after another: a compiled copy each.
    hlo = vg.lower(W, xs, ns, ks).compile().as_text()
    if isinstance(slots, int):
        assert dyndepth_loops(hlo) == {"forward": 2, "backward": 1}
    elif isinstance(slots, tuple):
        assert dyndepth_loops(hlo) == {"forward": 4, "backward": 2}


def test_return_all_gives_progressive_outputs_and_zero_rows():
    readout = jnp.sum
    n, k, max_k = 3, 4, 6
    s, ys = jax.jit(
        lambda W: dnn.recurrent_depth(
            core_of(W), S0, X, n=n, k=k, max_n=5, max_k=max_k, key=KEY,
            return_all=True, readout=readout,
        )
    )(W)  # fmt: skip
    ref_s, ref_ys = reference(W, X, S0, n, k, KEY, readout)
    tree_allclose(s, ref_s)
    tree_allclose(ys, jnp.concatenate([jnp.stack(ref_ys), jnp.zeros((max_k - k,))]))

    # Without readout the rows are the states; a progressive loss differentiates through them.
    def prog(W):
        _, states = dnn.recurrent_depth(
            core_of(W), S0, X, n=n, k=k, max_n=5, max_k=max_k, key=KEY, return_all=True
        )
        return jnp.sum(states**2), states

    (_, states), g = jax.jit(jax.value_and_grad(prog, has_aux=True))(W)
    assert states.shape == (max_k, D)
    assert np.all(np.asarray(states[k:]) == 0)
    ref_states = reference(W, X, S0, n, k, KEY)[1]
    tree_allclose(states[:k], jnp.stack(ref_states))
    ref_g = jax.grad(lambda W: sum(jnp.sum(y**2) for y in reference(W, X, S0, n, k, KEY)[1]))(W)
    tree_allclose(g, ref_g, **GTOL)


def test_keyless_core_typed_key_and_pytree_state():
    def core(s, x):
        return {"h": jnp.tanh(W @ s["h"] + x), "t": s["t"] + 1}

    state = {"h": S0, "t": jnp.zeros((), jnp.int32)}
    out = dnn.recurrent_depth(core, state, X, n=2, k=3, max_n=4, max_k=4)
    assert int(out["t"]) == 5
    tree_allclose(out, dyndepth.repeat(lambda s: core(s, X), state, 5, max_depth=5))
    typed = jax.random.key(7)
    got = jax.jit(
        lambda: dnn.recurrent_depth(core_of(W), S0, X, n=2, k=2, max_n=3, max_k=3, key=typed)
    )()
    manual = S0
    for j in range(4):
        manual = core_of(W)(manual, X, jax.random.fold_in(typed, j))
    tree_allclose(got, manual)


def test_gradient_memory_does_not_grow_with_n():
    """The first n iterations store nothing: XLA temp memory is flat in n (and in max_n)."""
    s0 = jnp.zeros((64, D))  # a state large enough for stored carries to dominate temp memory

    def core(W, s, x, key):
        return jnp.tanh(s @ W + x) * jax.random.uniform(key, (D,), minval=0.9, maxval=1.1)

    def temp_bytes(n, fn):
        lowered = jax.jit(jax.value_and_grad(lambda W, x: fn(W, x, n))).lower(W, X)
        return lowered.compile().memory_analysis().temp_size_in_bytes

    def truncated(W, x, n):
        core_w = lambda s, x, key: core(W, s, x, key)  # noqa: E731
        return loss_of(dnn.recurrent_depth(core_w, s0, x, n=n, k=8, max_n=n, max_k=8, key=KEY))

    def full(W, x, n):  # everything differentiated: memory follows n + k
        step = lambda s, key: core(W, s, x, key)  # noqa: E731
        return loss_of(dyndepth.repeat(step, s0, n + 8, max_depth=n + 8, key=KEY))

    small, large = temp_bytes(8, truncated), temp_bytes(64, truncated)
    assert large <= 1.2 * small, (small, large)
    assert temp_bytes(64, full) > 2 * large  # storing the 64 carries would show


def test_recurrent_depth_errors():
    core = core_of(W)
    kw = dict(max_n=4, max_k=4, key=KEY)
    with pytest.raises(ValueError, match=r"`n` must lie in \[0, max_n\] = \[0, 4\], got 5"):
        dnn.recurrent_depth(core, S0, X, n=5, k=1, **kw)
    with pytest.raises(ValueError, match=r"`k` must lie in \[0, max_k\] = \[0, 4\], got -1"):
        dnn.recurrent_depth(core, S0, X, n=1, k=-1, **kw)
    with pytest.raises(TypeError, match=r"`n` must have an integer dtype, got dtype float32"):
        dnn.recurrent_depth(core, S0, X, n=jnp.float32(1), k=1, **kw)
    with pytest.raises(ValueError, match=r"`max_k` must be >= 0, got -2"):
        dnn.recurrent_depth(core, S0, X, n=1, k=1, max_n=4, max_k=-2)
    with pytest.raises(TypeError, match=r"`core` must keep the shape and dtype of state"):
        dnn.recurrent_depth(lambda s, x, key: s[:2], S0, X, n=1, k=1, **kw)
    with pytest.raises(TypeError, match=r"`core` must be callable"):
        dnn.recurrent_depth(None, S0, X, n=1, k=1, **kw)
    with pytest.raises(ValueError, match=r"`strategy` must be one of .*got 'fast'"):
        dnn.recurrent_depth(core, S0, X, n=1, k=1, strategy="fast", **kw)
    with pytest.raises(TypeError, match=r"`key` must be a PRNG key"):
        dnn.recurrent_depth(core, S0, X, n=1, k=1, max_n=4, max_k=4, key=1)
    with pytest.raises(ValueError, match=r"`slots`=2 sets .* strategy 'auto' only, got strategy="
                       r"'checkpointed'"):  # fmt: skip
        dnn.recurrent_depth(core, S0, X, n=1, k=1, strategy="checkpointed", slots=2, **kw)
    with pytest.raises(ValueError, match=r"`slots` must be >= 1"):
        dnn.recurrent_depth(core, S0, X, n=1, k=1, slots=0, **kw)


def test_per_example_gradients_under_vmap_of_grad():
    """Per-sample gradients of a shared parameter (the batch sum must not leak into each)."""
    ns = jnp.array([1, 3], jnp.int32)
    xs = jax.random.normal(jax.random.PRNGKey(6), (2, D))
    keys = jax.random.split(KEY, 2)

    def loss(W, x, n, key):
        return loss_of(dnn.recurrent_depth(core_of(W), S0, x, n=n, k=2, max_n=3, max_k=2, key=key))

    def ref_loss(W, b):
        return loss_of(reference(W, xs[b], S0, int(ns[b]), 2, keys[b])[0])

    got = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0, 0)))(W, xs, ns, keys)
    ref = jnp.stack([jax.grad(ref_loss)(W, b) for b in range(2)])
    tree_allclose(got, ref, **GTOL)
