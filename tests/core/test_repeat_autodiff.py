"""``dyndepth.repeat`` differentiated, against plain-Python references and the ``"masked"``
strategy: reverse mode (``grad``, ``grad`` of ``vmap``, ``vmap`` of ``grad``, ``jacrev``, nested
loops), forward mode, the ``"while"`` strategy's reverse-mode error, forward over reverse."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import reference_repeat, seed_method, tree_allclose, tree_equal
from loop_setup import (
    DEPTHS,
    GTOL,
    KEY,
    KEYS,
    MAX,
    V0,
    W0,
    X0,
    XB,
    B,
    D,
    cached,
    dropout_layer,
    ref,
    ref_batch,
    run,
    tanh_layer,
)
from shared_lists import GRAD_CONFIGS, MID_GRAD_CONFIGS, SHORT_GRAD_CONFIGS, cfg_id

import dyndepth as dd

# ----------------------------------------------------------------------------- repeat: reverse mode


def loss_one(kind, strategy, checkpoints):
    def loss(x, W, d, key):
        return jnp.sum(run(kind, W, x, d, key, strategy, checkpoints) ** 2)

    return loss


def ref_loss_one(kind, d, key):
    def loss(x, W):
        return jnp.sum(ref(kind, W, x, d, key) ** 2)

    return loss


def loss_batch(kind, strategy, checkpoints):
    def loss(X, W, depths, keys):
        out = jax.vmap(lambda x, d, k: run(kind, W, x, d, k, strategy, checkpoints))(
            X, depths, keys
        )
        return jnp.sum(out**2)

    return loss


def ref_loss_batch(kind, depths, keys):
    def loss(X, W):
        return sum(jnp.sum(ref(kind, W, X[b], int(depths[b]), keys[b]) ** 2) for b in range(B))

    return loss


# Every config but ("auto", 2) with the keyed dropout layer; the keyless tanh layer with a few.
UNBATCHED_GRAD_CASES = [(c, "dropout") for c in GRAD_CONFIGS if c != ("auto", 2)] + [
    (("masked", None), "tanh"),
    (("checkpointed", None), "tanh"),
    (("checkpointed", 2), "tanh"),
]


@pytest.mark.parametrize(
    "cfg,kind",
    UNBATCHED_GRAD_CASES,
    ids=[f"{cfg_id(c)}-{k}" for c, k in UNBATCHED_GRAD_CASES],
)
def test_grad_matches_reference_and_masked(cfg, kind):
    strategy, ckpt = cfg
    grad = jax.jit(jax.grad(loss_one(kind, strategy, ckpt), argnums=(0, 1)))
    masked = jax.jit(jax.grad(loss_one(kind, "masked", None), argnums=(0, 1)))
    for d in (0, 2, MAX):
        g = grad(X0, W0, jnp.int32(d), KEY)
        expected = jax.grad(ref_loss_one(kind, d, KEY), argnums=(0, 1))(X0, W0)
        tree_allclose(g, expected, **GTOL, err_msg=f"vs reference, depth={d}")
        g_masked = cached(("grad", kind, d), lambda d=d: masked(X0, W0, jnp.int32(d), KEY))
        tree_allclose(g, g_masked, **GTOL, err_msg=f"vs masked, depth={d}")
    # depth 0: the loop is the identity, so d/dx sum(x**2) = 2x and W gets exactly zero.
    gx, gW = grad(X0, W0, jnp.int32(0), KEY)
    tree_allclose(gx, 2.0 * X0)
    tree_equal(gW, jnp.zeros_like(W0))


@pytest.mark.parametrize("cfg", GRAD_CONFIGS, ids=cfg_id)
def test_value_and_grad_of_vmapped_loss(cfg):
    """grad-of-vmap: loss = sum over the batch, per-sample depths and keys (dropout layer)."""
    kind = "dropout"
    strategy, ckpt = cfg
    vg = jax.jit(jax.value_and_grad(loss_batch(kind, strategy, ckpt), argnums=(0, 1)))
    val, g = vg(XB, W0, DEPTHS, KEYS)
    ref_val, ref_g = jax.value_and_grad(ref_loss_batch(kind, DEPTHS, KEYS), argnums=(0, 1))(XB, W0)
    tree_allclose(val, ref_val, err_msg="value")
    tree_allclose(g, ref_g, **GTOL, err_msg="grad vs reference")
    masked = jax.value_and_grad(loss_batch(kind, "masked", None), argnums=(0, 1))
    tree_allclose(
        (val, g),
        cached(("vag", kind), lambda: masked(XB, W0, DEPTHS, KEYS)),
        **GTOL,
        err_msg="vs masked",
    )
    # The depth-0 sample's input gradient is exactly 2 x.
    tree_allclose(g[0][0], 2.0 * XB[0])


def per_sample_reference_grads(W_of_b):
    return [
        jax.grad(ref_loss_one("dropout", int(DEPTHS[b]), KEYS[b]), argnums=(0, 1))(XB[b], W_of_b(b))
        for b in range(B)
    ]


@pytest.mark.parametrize("cfg", MID_GRAD_CONFIGS, ids=cfg_id)
def test_vmap_of_grad_per_sample_depth(cfg):
    """vmap(grad): per-sample depth, key, input and parameters."""
    strategy, ckpt = cfg
    Ws = jnp.stack([W0 * (1.0 + 0.2 * b) for b in range(B)])
    per_sample = jax.jit(jax.vmap(jax.grad(loss_one("dropout", strategy, ckpt), argnums=(0, 1))))
    gx, gW = per_sample(XB, Ws, DEPTHS, KEYS)
    expected = per_sample_reference_grads(lambda b: Ws[b])
    for b in range(B):
        tree_allclose((gx[b], gW[b]), expected[b], **GTOL, err_msg=f"sample {b}")


@pytest.mark.parametrize("cfg", SHORT_GRAD_CONFIGS, ids=cfg_id)
def test_vmap_of_grad_shared_parameter(cfg):
    """vmap(grad) with W shared by the batch (in_axes=None): per-sample gradients of W.

    Regression: the checkpointed backward's custom_vmap rule summed a shared parameter's gradient
    over the batch, so every sample got the batch-summed gradient instead of its own."""
    strategy, ckpt = cfg
    per_sample = jax.jit(
        jax.vmap(
            jax.grad(loss_one("dropout", strategy, ckpt), argnums=(0, 1)),
            in_axes=(0, None, 0, 0),
        )
    )
    gx, gW = per_sample(XB, W0, DEPTHS, KEYS)
    assert gW.shape == (B, D, D)
    expected = per_sample_reference_grads(lambda b: W0)
    for b in range(B):
        tree_allclose(gx[b], expected[b][0], **GTOL, err_msg=f"sample {b}: d/dx")
    for b in range(B):
        tree_allclose(gW[b], expected[b][1], **GTOL, err_msg=f"sample {b}: d/dW")


@pytest.mark.parametrize("cfg", SHORT_GRAD_CONFIGS, ids=cfg_id)
def test_jacrev_matches_reference(cfg):
    strategy, ckpt = cfg

    def outputs(X, W):
        return jax.vmap(lambda x, d: run("tanh", W, x, d, None, strategy, ckpt))(X, DEPTHS)

    def ref_outputs(X, W):
        return ref_batch("tanh", W, X, DEPTHS, KEYS)

    jac = jax.jacrev(outputs, argnums=(0, 1))(XB, W0)
    expected = jax.jacrev(ref_outputs, argnums=(0, 1))(XB, W0)
    tree_allclose(jac, expected, **GTOL)
    # Samples do not talk to each other: d out[b] / d X[c] == 0 for b != c.
    jx = np.asarray(jac[0])
    for b in range(B):
        for c in range(B):
            if b != c:
                np.testing.assert_array_equal(jx[b, :, c, :], 0.0)


@pytest.mark.parametrize("cfg", SHORT_GRAD_CONFIGS, ids=cfg_id)
def test_jacrev_unbatched_wrt_closed_over_param(cfg):
    """Regression: jacrev (a vmap of the backward over the cotangent basis) returned the sum of
    the Jacobian's rows in every row for a closed-over parameter."""
    strategy, ckpt = cfg

    def f(x, W):
        return run("tanh", W, x, 3, None, strategy, ckpt)

    jx, jW = jax.jacrev(f, argnums=(0, 1))(X0, W0)
    ex, eW = jax.jacrev(lambda x, W: ref("tanh", W, x, 3, None), argnums=(0, 1))(X0, W0)
    tree_allclose(jx, ex, **GTOL, err_msg="d out / d init")
    tree_allclose(jW, eW, **GTOL, err_msg="d out / d W")


@pytest.mark.parametrize("cfg", SHORT_GRAD_CONFIGS, ids=cfg_id)
def test_nested_repeat_per_sample_inner_depth(cfg):
    """A repeat inside repeat; outer and inner depths per sample under vmap."""
    strategy, ckpt = cfg
    outer_depths = jnp.array([2, 0, 3, 1], jnp.int32)
    inner_depths = jnp.array([1, 3, 0, 3], jnp.int32)

    def net(x, W, V, d, e):
        def block(c):
            inner = dd.repeat(tanh_layer(V), c, e, max_depth=3, strategy=strategy, checkpoints=ckpt)
            return jnp.tanh(W @ inner)

        return dd.repeat(block, x, d, max_depth=3, strategy=strategy, checkpoints=ckpt)

    def ref_net(x, W, V, d, e):
        return reference_repeat(lambda c: jnp.tanh(W @ reference_repeat(tanh_layer(V), c, e)), x, d)

    def loss(X, W, V):
        out = jax.vmap(net, in_axes=(0, None, None, 0, 0))(X, W, V, outer_depths, inner_depths)
        return jnp.sum(out**2)

    def ref_loss(X, W, V):
        return sum(
            jnp.sum(ref_net(X[b], W, V, int(outer_depths[b]), int(inner_depths[b])) ** 2)
            for b in range(B)
        )

    val, g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(XB, W0, V0)
    ref_val, ref_g = jax.value_and_grad(ref_loss, argnums=(0, 1, 2))(XB, W0, V0)
    tree_allclose(val, ref_val)
    tree_allclose(g, ref_g, **GTOL)


# ----------------------------------------------------------------------------- repeat: forward mode


@pytest.mark.parametrize("strategy", ["masked", "while"])
def test_jvp_and_jacfwd(strategy):
    kind = "dropout"
    tx = jnp.ones((D,)) * 0.5
    tW = jnp.eye(D)

    def f(x, W):
        return run(kind, W, x, 3, KEY, strategy)

    primal, tangent = jax.jvp(f, (X0, W0), (tx, tW))
    ref_primal, ref_tangent = jax.jvp(lambda x, W: ref(kind, W, x, 3, KEY), (X0, W0), (tx, tW))
    tree_allclose((primal, tangent), (ref_primal, ref_tangent), **GTOL, err_msg="jvp")

    def outputs(X, W):
        return jax.vmap(lambda x, d, k: run(kind, W, x, d, k, strategy))(X, DEPTHS, KEYS)

    jac = jax.jit(jax.jacfwd(outputs, argnums=(0, 1)))(XB, W0)
    expected = jax.jacfwd(lambda X, W: ref_batch(kind, W, X, DEPTHS, KEYS), argnums=(0, 1))(XB, W0)
    tree_allclose(jac, expected, **GTOL, err_msg="jacfwd vs reference")
    other = cached(
        ("jacfwd", kind), lambda: jax.jacfwd(outputs_for("masked", kind), argnums=(0, 1))(XB, W0)
    )
    tree_allclose(jac, other, **GTOL, err_msg="jacfwd vs masked")


def outputs_for(strategy, kind):
    def outputs(X, W):
        return jax.vmap(lambda x, d, k: run(kind, W, x, d, k, strategy))(X, DEPTHS, KEYS)

    return outputs


@pytest.mark.parametrize("mode", ["grad", "grad_of_vmap", "jacrev", "vjp"])
def test_while_strategy_rejects_reverse_mode(mode):
    def f(x, W):
        return run("tanh", W, x, 2, None, "while")

    def batched(X, W):
        return jax.vmap(lambda x, d: run("tanh", W, x, d, None, "while"))(X, DEPTHS)

    with pytest.raises(TypeError, match="checkpointed"):
        if mode == "grad":
            jax.grad(lambda x: jnp.sum(f(x, W0)))(X0)
        elif mode == "grad_of_vmap":
            jax.grad(lambda W: jnp.sum(batched(XB, W)))(W0)
        elif mode == "jacrev":
            jax.jacrev(f, argnums=1)(X0, W0)
        else:
            _, pullback = jax.vjp(f, X0, W0)
            pullback(jnp.ones((D,)))


# ----------------------------------------------------------------------------- forward-over-reverse

FOR_CONFIGS = [("checkpointed", None), ("auto", 2)]


@pytest.mark.parametrize("cfg", FOR_CONFIGS, ids=cfg_id)
def test_forward_over_reverse_of_vmapped_loss(cfg):
    """jacfwd(grad(loss)) (the Hessian in W) with the loop under vmap inside the loss."""
    strategy, ckpt = cfg

    def loss(W, strategy=strategy, ckpt=ckpt):
        return loss_batch("dropout", strategy, ckpt)(XB, W, DEPTHS, KEYS)

    hess = jax.jit(jax.jacfwd(jax.grad(loss)))(W0)
    assert hess.shape == (D, D, D, D) and np.any(np.asarray(hess) != 0)
    masked = cached(
        ("fwd-over-rev",),
        lambda: jax.jacfwd(jax.grad(lambda W: loss(W, "masked", None)))(W0),
    )
    tree_allclose(hess, masked, rtol=1e-4, atol=1e-4, err_msg="vs masked")

    def seed_loss(W):
        out = jax.vmap(lambda x, d, k: seed_method(dropout_layer(W), x, d, k, MAX))(
            XB, DEPTHS, KEYS
        )
        return jnp.sum(out**2)

    expected = cached(("fwd-over-rev-seed",), lambda: jax.jit(jax.hessian(seed_loss))(W0))
    tree_allclose(hess, expected, rtol=1e-4, atol=1e-4, err_msg="vs the seed's method")


@pytest.mark.parametrize("cfg", FOR_CONFIGS, ids=cfg_id)
def test_hvp_unbatched(cfg):
    """One Hessian-vector product, jvp of grad, on an unbatched loop."""
    strategy, ckpt = cfg
    tW = jnp.ones((D, D)) * 0.1

    def grad_fn(strategy, ckpt):
        return jax.grad(lambda W: loss_one("tanh", strategy, ckpt)(X0, W, 3, None))

    out = jax.jvp(grad_fn(strategy, ckpt), (W0,), (tW,))
    masked = cached(("hvp-masked",), lambda: jax.jvp(grad_fn("masked", None), (W0,), (tW,)))
    tree_allclose(out, masked, rtol=1e-4, atol=1e-4, err_msg="vs masked")
    expected = cached(
        ("hvp-ref",),
        lambda: jax.jvp(jax.grad(lambda W: ref_loss_one("tanh", 3, None)(X0, W)), (W0,), (tW,)),
    )
    tree_allclose(out, expected, rtol=1e-4, atol=1e-4, err_msg="vs reference")


@pytest.mark.parametrize(
    "cfg,kind",
    [(("checkpointed", None), "tanh"), (("checkpointed", None), "dropout"), (("auto", 2), "tanh")],
    ids=["checkpointed-tanh", "checkpointed-dropout", "auto-K2-tanh"],
)
def test_forward_over_reverse_unbatched(cfg, kind):
    """jacfwd(grad(.)) (the Hessian) of an unbatched loop, with and without checkpoints."""
    strategy, ckpt = cfg

    def loss(W, strategy=strategy, ckpt=ckpt):
        return loss_one(kind, strategy, ckpt)(X0, W, 3, KEY)

    hess = jax.jacfwd(jax.grad(loss))(W0)
    masked = jax.jacfwd(jax.grad(lambda W: loss(W, "masked", None)))(W0)
    tree_allclose(hess, masked, rtol=1e-4, atol=1e-4)
