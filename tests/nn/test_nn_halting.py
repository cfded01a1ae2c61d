"""Tests for ``dyndepth.nn.halting`` and ``ponder_loss`` against eager per-sample references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tree_allclose

import dyndepth.nn as dnn

D, B, M = 3, 6, 6
W = jax.random.normal(jax.random.PRNGKey(0), (D, D)) * 0.8
U = jax.random.normal(jax.random.PRNGKey(1), (D,)) * 1.5
# Initial states spread out, so that samples halt at different steps (some at max_steps).
XS = jax.random.normal(jax.random.PRNGKey(2), (B, D)) * jnp.linspace(0.2, 3.0, B)[:, None]
KEYS = jax.random.split(jax.random.PRNGKey(3), B)
GTOL = dict(rtol=1e-5, atol=1e-5)


def step_of(W, U, halt="probability"):
    def step(s, key):
        s = 0.7 * s + 0.3 * jnp.tanh(W @ s) + 0.1 * jax.random.normal(key, (D,))
        logit = U @ s - 0.5
        lam = logit if halt == "logit" else jax.nn.sigmoid(logit)
        return s, lam, {"loss": jnp.sum((s - 1.0) ** 2), "vec": s}

    return step


def reference(W, U, s, key, *, threshold, kind, halt="probability", normalize=True):
    """The docstring's loop, eagerly for one sample."""
    step = step_of(W, U, halt)
    p, ys, rest, t = [], [], 1.0, 0
    while t < M and 1 - rest < threshold:
        s, lam, y = step(s, jax.random.fold_in(key, t))
        if halt == "logit":
            lam = jax.nn.sigmoid(lam)
        if kind == "pondernet":
            p.append(lam * rest)
            rest = rest * (1 - lam)
        else:
            p.append(lam)
            rest = rest - lam
        ys.append(y)
        t += 1
    if normalize:
        p[-1] = p[-1] + rest
    zero_y = jax.tree_util.tree_map(jnp.zeros_like, ys[0])
    ys = ys + [zero_y] * (M - t)
    outputs = jax.tree_util.tree_map(lambda *r: jnp.stack(r), *ys)
    return s, outputs, jnp.stack(p + [jnp.float32(0.0)] * (M - t)), t


def batched(W, U, xs, keys, **kw):
    return jax.vmap(lambda s, k: dnn.halting(step_of(W, U, kw.get("halt", "probability")), s,
                                             max_steps=M, key=k, **kw))(xs, keys)  # fmt: skip


CASES = [
    dict(threshold=0.9, kind="pondernet"),
    dict(threshold=0.95, kind="act", halt="logit"),
    dict(threshold=0.8, kind="pondernet", normalize=False, strategy="masked"),
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(map(str, kw.values())))
def test_halting_matches_eager_per_sample_reference(kw):
    out = jax.jit(lambda W, U: batched(W, U, XS, KEYS, **kw))(W, U)
    ref_kw = {k: v for k, v in kw.items() if k != "strategy"}
    steps = []
    for b in range(B):
        s, outputs, p, t = reference(W, U, XS[b], KEYS[b], **ref_kw)
        steps.append(t)
        assert int(out.steps[b]) == t, f"sample {b}"
        tree_allclose(
            (out.state[b], jax.tree_util.tree_map(lambda a, b=b: a[b], out.outputs), out.p[b]),
            (s, outputs, p),
            err_msg=f"sample {b}",
        )
    assert len(set(steps)) > 1, steps  # the samples really stop at different steps
    if kw.get("normalize", True):
        tree_allclose(jnp.sum(out.p, axis=-1), jnp.ones((B,)), atol=1e-6)


def test_halting_gradient_of_ponder_loss_matches_reference():
    kw = dict(threshold=0.9, kind="pondernet")
    nb = 2  # samples 0 and 1 stop at steps 6 and 5

    def loss(W, U):
        out = batched(W, U, XS[:nb], KEYS[:nb], **kw)
        return jnp.sum(dnn.ponder_loss(out.outputs["loss"], out.p, prior_lambda=0.3, beta=0.1))

    def ref_loss(W, U):
        total = 0.0
        for b in range(nb):
            _, outputs, p, _ = reference(W, U, XS[b], KEYS[b], **kw)
            total = total + dnn.ponder_loss(outputs["loss"], p, prior_lambda=0.3, beta=0.1)
        return total

    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(W, U)
    tree_allclose(got, jax.value_and_grad(ref_loss, argnums=(0, 1))(W, U), **GTOL)


def test_halting_single_sample_without_key_and_threshold_one():
    def step(s):
        return s + 1.0, jnp.float32(0.5), s

    out = dnn.halting(step, jnp.zeros(()), max_steps=4, threshold=1.0)
    assert int(out.steps) == 4
    tree_allclose(out.p, jnp.array([0.5, 0.25, 0.125, 0.125], jnp.float32))
    tree_allclose(out.outputs, jnp.array([0.0, 1.0, 2.0, 3.0]))
    first = dnn.halting(lambda s: (s, jnp.float32(1.0), s), jnp.zeros(()), max_steps=4)
    assert int(first.steps) == 1 and float(first.p[0]) == 1.0


def test_ponder_loss_formula():
    p = jnp.array([[0.5, 0.3, 0.2, 0.0], [0.1, 0.2, 0.3, 0.4]], jnp.float32)
    losses = jnp.array([[1.0, 2.0, 3.0, 99.0], [4.0, 3.0, 2.0, 1.0]], jnp.float32)
    lam = 0.4
    q = lam * (1 - lam) ** np.arange(4)
    q = q / q.sum()
    pn = np.asarray(p, np.float64)
    kl = np.sum(np.where(pn > 0, pn * (np.log(np.where(pn > 0, pn, 1)) - np.log(q)), 0), -1)
    expected = np.sum(pn * np.asarray(losses), -1) + 0.5 * kl
    got = dnn.ponder_loss(losses, p, prior_lambda=lam, beta=0.5)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5)
    # KL is zero at the prior, and the gradient stays finite where p is zero.
    qa = jnp.asarray(q, jnp.float32)
    assert abs(float(dnn.ponder_loss(jnp.zeros(4), qa, prior_lambda=lam, beta=1.0))) < 1e-6
    g = jax.grad(lambda p: jnp.sum(dnn.ponder_loss(losses, p, prior_lambda=lam, beta=0.5)))(p)
    assert np.all(np.isfinite(np.asarray(g)))


def test_halting_and_ponder_loss_errors():
    step = step_of(W, U)
    s0 = XS[0]
    with pytest.raises(ValueError, match=r"`threshold` must lie in \(0, 1\], got 1.5"):
        dnn.halting(step, s0, max_steps=3, threshold=1.5, key=KEYS[0])
    with pytest.raises(ValueError, match=r"`max_steps` must be >= 1, got 0"):
        dnn.halting(step, s0, max_steps=0, key=KEYS[0])
    with pytest.raises(ValueError, match=r"`kind` must be one of \('pondernet', 'act'\)"):
        dnn.halting(step, s0, max_steps=3, kind="ponder", key=KEYS[0])
    with pytest.raises(ValueError, match=r"`halt` must be one of"):
        dnn.halting(step, s0, max_steps=3, halt="prob", key=KEYS[0])
    with pytest.raises(TypeError, match=r"must return a tuple \(state, lam, y\)"):
        dnn.halting(lambda s: s, s0, max_steps=3)
    with pytest.raises(TypeError, match=r"float scalar halting probability .* got float32\[3\]"):
        dnn.halting(lambda s: (s, s, s), s0, max_steps=3)
    with pytest.raises(TypeError, match=r"`step_fn` must keep the shape and dtype of state"):
        dnn.halting(lambda s: (s[:2], s[0], s), s0, max_steps=3)
    with pytest.raises(ValueError, match=r"`prior_lambda` must lie in \(0, 1\], got 0.0"):
        dnn.ponder_loss(jnp.zeros(3), jnp.zeros(3), prior_lambda=0.0, beta=0.1)
    with pytest.raises(ValueError, match=r"`beta` must be >= 0, got -1.0"):
        dnn.ponder_loss(jnp.zeros(3), jnp.zeros(3), prior_lambda=0.5, beta=-1.0)
    with pytest.raises(ValueError, match=r"must have the same shape \(\.\.\., N\)"):
        dnn.ponder_loss(jnp.zeros(3), jnp.zeros(4), prior_lambda=0.5, beta=0.1)
