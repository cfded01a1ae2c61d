"""Tests for ``dyndepth.repeat`` and ``dyndepth.scan`` against plain-Python references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    Counter,
    expect_errors,
    reference_repeat,
    reference_scan,
    seed_method,
    tree_allclose,
    tree_equal,
)
from shared_lists import GRAD_CONFIGS, MID_GRAD_CONFIGS, SHORT_GRAD_CONFIGS, STRATEGIES, cfg_id

import dyndepth as dd

D = 3
B = 4
MAX = 5
W0 = jax.random.normal(jax.random.PRNGKey(0), (D, D)) * 0.6
V0 = jax.random.normal(jax.random.PRNGKey(5), (D, D)) * 0.6
X0 = jax.random.normal(jax.random.PRNGKey(1), (D,))
XB = jax.random.normal(jax.random.PRNGKey(2), (B, D))
KEY = jax.random.PRNGKey(3)
KEYS = jax.random.split(jax.random.PRNGKey(4), B)
# Per-sample depths: include 0 and MAX, and all distinct so a mixed-up sample shows.
DEPTHS = jnp.array([0, 2, MAX, 3], jnp.int32)

KINDS = ["tanh", "dropout"]
# Gradients reach magnitudes ~10 in float32: absolute tolerance a little looser than for values.
GTOL = dict(rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------- layers


def tanh_layer(W):
    """The seed's residual layer ``x + tanh(W x)``, closing over ``W``."""

    def f(x):
        return x + jnp.tanh(W @ x)

    return f


def dropout_layer(W, keep=0.6):
    """A dropout-style residual layer: a Bernoulli mask drawn from the step key."""

    def f(x, k):
        mask = jax.random.bernoulli(k, keep, x.shape)
        return x + jnp.where(mask, jnp.tanh(W @ x) / keep, 0.0)

    return f


def layer(kind, W):
    return tanh_layer(W) if kind == "tanh" else dropout_layer(W)


def key_for(kind, key):
    return None if kind == "tanh" else key


def run(kind, W, x, d, key, strategy="auto", checkpoints=None, max_depth=MAX):
    return dd.repeat(
        layer(kind, W),
        x,
        d,
        max_depth=max_depth,
        key=key_for(kind, key),
        strategy=strategy,
        checkpoints=checkpoints,
    )


def ref(kind, W, x, d, key):
    return reference_repeat(layer(kind, W), x, int(d), key=key_for(kind, key))


def ref_batch(kind, W, X, depths, keys):
    return jnp.stack(
        [ref(kind, W, X[b], int(depths[b]), keys[b]) for b in range(X.shape[0])],
    )


_CACHE: dict = {}


def cached(name, thunk):
    """Compute a comparison target (the ``"masked"`` strategy's result, a reference) once per
    test family and reuse it across the parametrized cases."""
    if name not in _CACHE:
        _CACHE[name] = jax.device_get(thunk())
    return _CACHE[name]


# ----------------------------------------------------------------------------- repeat: values


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_repeat_concrete_depth_matches_reference(strategy):
    """Python-int depths, eager (every call compiles, so few depths here; the jitted test below
    runs all of 0, 1, 3 and max_depth for both layers)."""
    for kind, depths in (("tanh", (1, MAX)), ("dropout", (0, 3))):
        for d in depths:
            out = run(kind, W0, X0, d, KEY, strategy)
            tree_allclose(out, ref(kind, W0, X0, d, KEY), err_msg=f"{kind}, depth={d}")
            if d == 0:  # depth 0 returns init itself, bit for bit.
                tree_equal(out, X0, err_msg=kind)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_repeat_jit_traced_depth(strategy):
    for kind in KINDS:
        traces = []

        @jax.jit
        def fn(x, d, key, kind=kind, traces=traces):
            traces.append(None)
            return run(kind, W0, x, d, key, strategy)

        for d in (0, 1, 3, MAX):
            out = fn(X0, jnp.int32(d), KEY)
            tree_allclose(out, ref(kind, W0, X0, d, KEY), err_msg=f"{kind}, depth={d}")
        assert len(traces) == 1, kind


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_repeat_vmap_per_sample_depth_and_key(strategy):
    for kind in KINDS:
        fn = jax.jit(jax.vmap(lambda x, d, k, kind=kind: run(kind, W0, x, d, k, strategy)))
        out = fn(XB, DEPTHS, KEYS)
        tree_allclose(out, ref_batch(kind, W0, XB, DEPTHS, KEYS), err_msg=kind)
        # The depth-0 sample is returned untouched.
        tree_equal(out[0], XB[0], err_msg=kind)
        # A different assignment of depths to samples moves the results with it.
        perm = DEPTHS[::-1]
        tree_allclose(fn(XB, perm, KEYS), ref_batch(kind, W0, XB, perm, KEYS), err_msg=kind)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_repeat_vmap_shared_depth(strategy):
    """One (unbatched) depth for the batch, per-sample inputs and keys."""

    def one(x, d, k):
        return run("dropout", W0, x, d, k, strategy)

    fn = jax.jit(jax.vmap(one, in_axes=(0, None, 0)))
    for d in (0, 3, MAX):
        expected = ref_batch("dropout", W0, XB, [d] * B, KEYS)
        tree_allclose(fn(XB, jnp.int32(d), KEYS), expected, err_msg=f"traced depth={d}")
    # A Python-int depth under vmap (not jitted).
    out = jax.vmap(lambda x, k: run("dropout", W0, x, 2, k, strategy))(XB, KEYS)
    tree_allclose(out, ref_batch("dropout", W0, XB, [2] * B, KEYS))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_traced_depth_out_of_range_is_clamped(strategy):
    """Documented: a traced depth outside [0, max_depth] is clamped (a concrete one raises)."""
    fn = jax.jit(lambda x, d: run("tanh", W0, x, d, None, strategy))
    tree_equal(fn(X0, jnp.int32(-3)), X0)
    tree_allclose(fn(X0, jnp.int32(MAX + 5)), ref("tanh", W0, X0, MAX, None))
    # Per sample under vmap as well.
    depths = jnp.array([-3, MAX + 5, 1, -1], jnp.int32)
    out = jax.jit(jax.vmap(fn))(XB, depths)
    clamped = np.clip(np.asarray(depths), 0, MAX)
    tree_allclose(out, ref_batch("tanh", W0, XB, clamped, KEYS))


def test_traced_large_unsigned_depth_is_clamped_to_max_depth():
    """Regression: a traced uint32 depth >= 2**31 was cast to int32 (wrapping negative) before
    clamping, and ran 0 steps instead of max_depth."""
    fn = jax.jit(lambda x, d: run("tanh", W0, x, d, None))
    tree_allclose(fn(X0, jnp.uint32(2**31 + 5)), ref("tanh", W0, X0, MAX, None))
    depths = jnp.array([2**32 - 1, 2**31, 2, 0], jnp.uint32)
    out = jax.jit(jax.vmap(fn))(XB, depths)
    tree_allclose(out, ref_batch("tanh", W0, XB, [MAX, MAX, 2, 0], KEYS))


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


# ----------------------------------------------------------------------------- the seed's method


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_seed_method_matches_repeat(strategy):
    def seed_out(X, W):
        return jax.vmap(lambda x, d, k: seed_method(dropout_layer(W), x, d, k, MAX))(
            X, DEPTHS, KEYS
        )

    def dd_out(X, W):
        return jax.vmap(lambda x, d, k: run("dropout", W, x, d, k, strategy))(X, DEPTHS, KEYS)

    def loss(out_fn):
        return lambda X, W: jnp.mean(out_fn(X, W) ** 2)

    seed_values = cached(("seed-values",), lambda: jax.jit(seed_out)(XB, W0))
    tree_allclose(jax.jit(dd_out)(XB, W0), seed_values, err_msg="values")
    if strategy != "while":
        g = jax.jit(jax.grad(loss(dd_out), argnums=(0, 1)))(XB, W0)
        g_seed = cached(
            ("seed-grads",), lambda: jax.jit(jax.grad(loss(seed_out), argnums=(0, 1)))(XB, W0)
        )
        tree_allclose(g, g_seed, **GTOL, err_msg="grads")


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


# ----------------------------------------------------------------------------- mixed-dtype carries


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_int_and_bool_leaves_in_carry(strategy):
    def f(c):
        x = c["x"] + jnp.tanh(W0 @ c["x"]) * c["scale"]
        return {
            "x": x,
            "step": c["step"] + 1,
            "flag": jnp.logical_not(c["flag"]),
            "hist": c["hist"].at[c["step"]].set(c["step"] * 10),
            "scale": c["scale"],
        }

    def init(x, s):
        return {
            "x": x,
            "step": jnp.int32(0),
            "flag": jnp.array(True),
            "hist": jnp.full((MAX,), -1, jnp.int32),
            "scale": s,
        }

    def net(x, s, d):
        return dd.repeat(f, init(x, s), d, max_depth=MAX, strategy=strategy)

    scales = jnp.linspace(0.5, 1.0, B)
    out = jax.jit(jax.vmap(net))(XB, scales, DEPTHS)
    for b in range(B):
        d = int(DEPTHS[b])
        expected = reference_repeat(f, init(XB[b], scales[b]), d)
        tree_allclose(jax.tree_util.tree_map(lambda a, b=b: a[b], out), expected, err_msg=f"{b}")
        assert int(out["step"][b]) == d
        assert bool(out["flag"][b]) == (d % 2 == 0)
    tree_equal(out["hist"][1], jnp.array([0, 10, -1, -1, -1], jnp.int32))

    def loss(X, s):
        return jnp.sum(jax.vmap(net)(X, s, DEPTHS)["x"] ** 2)

    def ref_loss(X, s):
        return sum(
            jnp.sum(reference_repeat(f, init(X[b], s[b]), int(DEPTHS[b]))["x"] ** 2)
            for b in range(B)
        )

    if strategy == "while":
        tX = jnp.ones_like(XB)
        tree_allclose(
            jax.jvp(lambda X: loss(X, scales), (XB,), (tX,)),
            jax.jvp(lambda X: ref_loss(X, scales), (XB,), (tX,)),
            **GTOL,
        )
    else:
        g = jax.jit(jax.grad(loss, argnums=(0, 1)))(XB, scales)
        tree_allclose(g, jax.grad(ref_loss, argnums=(0, 1))(XB, scales), **GTOL)


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


# ----------------------------------------------------------------------------- errors


def _f(c):
    return c


def _fk(c, k):
    return c


def _bad_shape(c):
    return {"a": c["a"][:2], "b": c["b"]}


def _bad_dtype(c):
    return {"a": c["a"], "b": c["b"].astype(jnp.int32)}


def _bad_structure(c):
    return {"a": c["a"]}


def _bad_container(c):
    return [c["a"], c["b"]]


TREE = {"a": jnp.zeros(3), "b": jnp.ones(3)}

REPEAT_ERRORS = {
    "max_depth-negative": (dict(max_depth=-1), ValueError, r"`max_depth` must be >= 0"),
    "max_depth-float": (dict(max_depth=2.5), TypeError, r"`max_depth` must be a static Python int"),
    "max_depth-bool": (dict(max_depth=True), TypeError, r"`max_depth`.*bool"),
    "max_depth-array": (
        dict(max_depth=jnp.int32(3)),
        TypeError,
        r"`max_depth` must be a static Python int",
    ),
    "depth-negative": (dict(depth=-1), ValueError, r"`depth` must lie in \[0, max_depth\]"),
    "depth-too-big": (dict(depth=MAX + 1), ValueError, r"\[0, 5\], got 6"),
    "depth-array-too-big": (dict(depth=jnp.int32(MAX + 1)), ValueError, r"got 6"),
    "depth-float": (dict(depth=2.0), TypeError, r"`depth` must be a Python int or an integer"),
    "depth-float-array": (dict(depth=jnp.float32(2.0)), TypeError, r"`depth`.*integer dtype"),
    "depth-bool": (dict(depth=True), TypeError, r"`depth` must be an integer, got bool"),
    "depth-bool-array": (dict(depth=jnp.array(True)), TypeError, r"`depth`.*integer dtype"),
    "depth-not-scalar": (dict(depth=jnp.array([1, 2])), ValueError, r"`depth` must be a scalar"),
    "f-not-callable": (dict(f=3), TypeError, r"`f` must be callable"),
    "f-changes-shape": (
        dict(f=_bad_shape, init=TREE),
        TypeError,
        r"carry\['a'\].*float32\[3\].*float32\[2\]",
    ),
    "f-changes-dtype": (
        dict(f=_bad_dtype, init=TREE),
        TypeError,
        r"carry\['b'\].*float32\[3\].*int32\[3\]",
    ),
    "f-changes-structure": (
        dict(f=_bad_structure, init=TREE),
        TypeError,
        r"same pytree structure",
    ),
    "f-changes-container": (
        dict(f=_bad_container, init=TREE),
        TypeError,
        r"same pytree structure",
    ),
    "strategy-unknown": (dict(strategy="fast"), ValueError, r"`strategy` must be one of"),
    "key-float-array": (dict(f=_fk, key=jnp.zeros(2)), TypeError, r"`key` must be a PRNG key"),
    "key-uint32-wrong-shape": (
        dict(f=_fk, key=jnp.zeros(3, jnp.uint32)),
        TypeError,
        r"`key` must be a PRNG key.*shape \(3,\)",
    ),
    "key-int": (dict(f=_fk, key=7), TypeError, r"`key` must be a PRNG key"),
    "key-batch-of-typed-keys": (
        dict(f=_fk, key=jax.random.split(jax.random.key(0), 2)),
        TypeError,
        r"single PRNG key",
    ),
    "checkpoints-zero": (dict(checkpoints=0), ValueError, r"`checkpoints` must be >= 1"),
    "checkpoints-float": (dict(checkpoints=1.5), TypeError, r"`checkpoints`"),
}


def _call_repeat(overrides):
    kwargs = dict(f=_f, init=jnp.zeros(3), depth=1, max_depth=MAX)
    kwargs.update(overrides)
    f, init, depth = kwargs.pop("f"), kwargs.pop("init"), kwargs.pop("depth")
    dd.repeat(f, init, depth, **kwargs)


REPEAT_ERROR_GROUPS = sorted({name.split("-")[0] for name in REPEAT_ERRORS})


@pytest.mark.parametrize("group", REPEAT_ERROR_GROUPS)
def test_repeat_errors(group):
    names = [n for n in REPEAT_ERRORS if n.split("-")[0] == group]
    expect_errors(REPEAT_ERRORS, names, _call_repeat)


BATCH_X = jnp.zeros((3, 2))
BATCH_D = jnp.zeros((3,), jnp.int32)

REPEAT_BATCHED_ERRORS = {
    "depths-2d": (dict(depths=jnp.zeros((3, 1), jnp.int32)), ValueError, r"`depths`.*\(3, 1\)"),
    "depths-float": (dict(depths=jnp.zeros((3,))), TypeError, r"`depths`.*integer dtype"),
    "depths-scalar-float": (dict(depths=2.0), TypeError, r"`depths` must be an integer array"),
    "depths-scalar-out-of-range": (
        dict(depths=5),
        ValueError,
        r"`depths` must lie in \[0, max_depth\] = \[0, 4\], got 5$",
    ),
    "depths-out-of-range": (
        dict(depths=jnp.array([1, 9, 0])),
        ValueError,
        r"`depths`.*\[0, 4\], got 9 at batch index 1",
    ),
    "inits-mismatched-batch": (
        dict(inits={"a": BATCH_X, "b": jnp.zeros((2, 2))}),
        ValueError,
        r"leading batch axis of size 3.*inits\['b'\] has shape \(2, 2\)",
    ),
    "keys-count": (
        dict(f=_fk, keys=jax.random.split(jax.random.key(0), 2)),
        ValueError,
        r"`keys` needs a leading batch axis of size 3",
    ),
    "keys-float": (dict(f=_fk, keys=jnp.zeros((3, 2))), TypeError, r"`keys\[0\]` must be a PRNG"),
    "f-not-callable": (dict(f=None), TypeError, r"`f` must be callable"),
    "f-changes-shape": (dict(f=lambda c: c[:1]), TypeError, r"float32\[2\].*float32\[1\]"),
    "max_depth-negative": (dict(max_depth=-2), ValueError, r"`max_depth` must be >= 0"),
    "max_depth-float": (dict(max_depth=1e9), TypeError, r"`max_depth` must be a static Python"),
    "max_depth-beyond-int32": (
        dict(max_depth=2**31),
        ValueError,
        r"`max_depth` must be <= 2\*\*31",
    ),
    "slots-zero": (dict(slots=0), ValueError, r"`slots` must be >= 1, got 0"),
    "slots-unknown-rule": (
        dict(slots="time"),
        ValueError,
        r"`slots` must be None, \"work\", a slot count or a sequence of them, got 'time'",
    ),
    "checkpoints-negative": (dict(checkpoints=-1), ValueError, r"`checkpoints` must be >= 1"),
}


def _call_repeat_batched(overrides):
    kwargs = dict(f=_f, inits=BATCH_X, depths=BATCH_D, max_depth=4)
    kwargs.update(overrides)
    f, inits, depths = kwargs.pop("f"), kwargs.pop("inits"), kwargs.pop("depths")
    dd.repeat_batched(f, inits, depths, **kwargs)


def test_repeat_batched_errors():
    expect_errors(REPEAT_BATCHED_ERRORS, list(REPEAT_BATCHED_ERRORS), _call_repeat_batched)


def test_sizes_beyond_int32_are_rejected():
    """Step counters are int32: a larger static size would wrap, so it raises instead."""
    with pytest.raises(ValueError, match=r"`max_depth` must be <= 2\*\*31 - 1"):
        dd.repeat(_f, jnp.zeros(3), 1, max_depth=10**10)
    with pytest.raises(ValueError, match=r"`max_steps` must be <= 2\*\*31 - 1"):
        dd.while_loop(lambda c: True, lambda c: c, jnp.zeros(3), max_steps=2**40)
    with pytest.raises(ValueError, match=r"`checkpoints` must be <= 2\*\*31 - 1"):
        dd.repeat(_f, jnp.zeros(3), 1, max_depth=4, checkpoints=2**31)


def test_traced_float_depth_raises():
    with pytest.raises(TypeError, match=r"`depth`.*integer dtype"):
        jax.jit(lambda d: dd.repeat(_f, X0, d, max_depth=MAX))(2.0)


# ----------------------------------------------------------------------------- scan

L = 4
XS = jax.random.normal(jax.random.PRNGKey(6), (L, D))


def scan_body(W, keyed):
    def step(c, x, k=None):
        h = jnp.tanh(W @ c + x)
        if keyed:
            h = h * jax.random.uniform(k, (), minval=0.5, maxval=1.5)
        c = c + h
        return c, {"h": c, "s": jnp.sum(c), "one": jnp.int32(1)}

    if keyed:
        return step
    return lambda c, x: step(c, x)


def scan_run(kind, W, c, xs, d, key, strategy="auto", checkpoints=None):
    keyed = kind == "dropout"
    return dd.scan(
        scan_body(W, keyed),
        c,
        xs,
        depth=d,
        key=key if keyed else None,
        strategy=strategy,
        checkpoints=checkpoints,
    )


def scan_ref(kind, W, c, xs, d, key):
    keyed = kind == "dropout"
    return reference_scan(scan_body(W, keyed), c, xs, int(d), L, key=key if keyed else None)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_scan_matches_reference(strategy):
    for kind in KINDS:
        fn = jax.jit(lambda c, xs, d, k, kind=kind: scan_run(kind, W0, c, xs, d, k, strategy))
        for d in (0, 2, L):
            carry, ys = fn(X0, XS, jnp.int32(d), KEY)
            expected = scan_ref(kind, W0, X0, XS, d, KEY)
            tree_allclose((carry, ys), expected, err_msg=f"{kind}, depth={d}")
            # Rows at steps >= depth are exactly zero, rows before are the steps' outputs.
            for name, leaf in ys.items():
                assert leaf.shape[0] == L
                np.testing.assert_array_equal(
                    np.asarray(leaf[d:]), 0, err_msg=f"{kind}: ys['{name}'], depth={d}"
                )
            np.testing.assert_array_equal(np.asarray(ys["one"]), [1] * d + [0] * (L - d))
        # Each step sees its own row of xs: reversing xs changes the outputs from step 0 on.
        shifted = fn(X0, XS[::-1], jnp.int32(L), KEY)
        tree_allclose(shifted, scan_ref(kind, W0, X0, XS[::-1], L, KEY), err_msg=kind)
        assert not np.allclose(
            np.asarray(shifted[1]["h"][0]), np.asarray(fn(X0, XS, jnp.int32(L), KEY)[1]["h"][0])
        )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_scan_vmap_per_sample_depth(strategy):
    fn = jax.jit(
        jax.vmap(lambda c, d, k: scan_run("dropout", W0, c, XS, d, k, strategy), in_axes=(0, 0, 0))
    )
    depths = jnp.array([0, 3, L, 1], jnp.int32)
    carry, ys = fn(XB, depths, KEYS)
    for b in range(B):
        expected = scan_ref("dropout", W0, XB[b], XS, int(depths[b]), KEYS[b])
        got = jax.tree_util.tree_map(lambda a, b=b: a[b], (carry, ys))
        tree_allclose(got, expected, err_msg=f"sample {b}")


def scan_loss(run_fn):
    def loss(c, xs, W):
        carry, ys = run_fn(c, xs, W)
        weights = jnp.arange(1, L + 1, dtype=jnp.float32)
        return jnp.sum(carry**2) + jnp.sum(ys["s"] * weights) + jnp.sum(jnp.sin(ys["h"]))

    return loss


@pytest.mark.parametrize("cfg", MID_GRAD_CONFIGS, ids=cfg_id)
def test_scan_gradients(cfg):
    """Grads w.r.t. init, xs (shared by the batch) and W; per-sample depths and keys."""
    strategy, ckpt = cfg
    depths = jnp.array([0, 3, L, 1], jnp.int32)

    def batched(strategy, ckpt):
        def fn(C, xs, W):
            return jax.vmap(
                lambda c, d, k: scan_run("dropout", W, c, xs, d, k, strategy, ckpt),
            )(C, depths, KEYS)

        return fn

    def loss(strategy, ckpt):
        def total(C, xs, W):
            carry, ys = batched(strategy, ckpt)(C, xs, W)
            weights = jnp.arange(1, L + 1, dtype=jnp.float32)
            return jnp.sum(carry**2) + jnp.sum(ys["s"] * weights) + jnp.sum(jnp.sin(ys["h"]))

        return total

    def ref_loss(C, xs, W):
        total = 0.0
        for b in range(B):
            total = total + scan_loss(
                lambda c, xs, W, b=b: scan_ref("dropout", W, c, xs, int(depths[b]), KEYS[b])
            )(C[b], xs, W)
        return total

    g = jax.jit(jax.grad(loss(strategy, ckpt), argnums=(0, 1, 2)))(XB, XS, W0)
    tree_allclose(
        g, jax.grad(ref_loss, argnums=(0, 1, 2))(XB, XS, W0), **GTOL, err_msg="vs reference"
    )
    masked = cached(
        ("scan-grad",), lambda: jax.grad(loss("masked", None), argnums=(0, 1, 2))(XB, XS, W0)
    )
    tree_allclose(g, masked, **GTOL, err_msg="vs masked")
    # Only sample 2 (depth L) reaches the last step, so xs[L - 1] gets its gradient from it alone.
    assert np.any(np.asarray(g[1][L - 1]) != 0)


def test_scan_without_xs_uses_length_and_passes_none():
    seen = []

    def f(c, x):
        seen.append(x)
        return c * 2.0, c

    carry, ys = dd.scan(f, jnp.float32(1.0), None, depth=2, length=4)
    assert all(x is None for x in seen) and seen
    tree_allclose(carry, jnp.float32(4.0))
    tree_allclose(ys, jnp.array([1.0, 2.0, 0.0, 0.0], jnp.float32))


def test_scan_length_zero():
    carry, ys = dd.scan(lambda c, x: (c + 1.0, {"y": c}), X0, None, depth=0, length=0)
    tree_equal(carry, X0)
    assert ys["y"].shape == (0, D)


SCAN_ERRORS = {
    "length-mismatch": (dict(xs=XS, length=L + 1), ValueError, r"`length`=5 but the leading axis"),
    "no-xs-no-length": (dict(xs=None), ValueError, r"needs `xs` or `length`"),
    "xs-leading-axes-differ": (
        dict(xs={"a": XS, "b": jnp.zeros((L - 1, 2))}),
        ValueError,
        r"different leading axes: \[3, 4\]",
    ),
    "xs-scalar-leaf": (
        dict(xs={"a": XS, "b": jnp.float32(1.0)}),
        ValueError,
        r"xs\['b'\] is a scalar",
    ),
    "depth-above-length": (dict(xs=XS, depth=L + 1), ValueError, r"\[0, length\] = \[0, 4\]"),
    "length-negative": (dict(xs=None, length=-1), ValueError, r"`length` must be >= 0"),
    "f-changes-carry-dtype": (
        dict(xs=XS, f=lambda c, x: (c.astype(jnp.int32), None)),
        TypeError,
        r"carry<root>.*int32",
    ),
}


def _call_scan(overrides):
    kwargs = dict(f=lambda c, x: (c, None), init=X0, depth=1)
    kwargs.update(overrides)
    f, init, xs = kwargs.pop("f"), kwargs.pop("init"), kwargs.pop("xs")
    dd.scan(f, init, xs, **kwargs)


def test_scan_errors():
    expect_errors(SCAN_ERRORS, list(SCAN_ERRORS), _call_scan)
