"""Numerical reliability: NaN/inf past a sample's depth, low-precision carries, integer leaves,
bitwise determinism, the per-step key schedule under vmap/scheduler/backward, and no retracing.

Complements ``test_keys.py`` (unbatched key recording, key kinds) and ``test_repeat_cost.py``
(forward no-recompile of ``repeat``); nothing here repeats those.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    applicable,
    reference_repeat,
    reference_scan,
    reference_while,
    tree_allclose,
    tree_equal,
)
from jax import lax
from shared_lists import GRAD_STRATEGIES, STRATEGIES, cfg_id

import dyndepth as dd

GTOL = dict(rtol=1e-5, atol=1e-4)


def finite(tree) -> bool:
    return all(bool(np.all(np.isfinite(np.asarray(x)))) for x in jax.tree_util.tree_leaves(tree))


# ============================================================================= NaN / inf past depth
#
# ``x -> x - 1 + w log(x)`` from x0 = 3.5 (w = 0.1) stays positive for 3 steps, is negative
# after the 4th (SAFE) and NaN from the 5th on: any depth <= SAFE is finite, but a loop that
# evaluates the step past a sample's depth (masked rows under vmap, the scheduler's idle
# slots, recomputation buffers) meets log(negative) = NaN, whose Jacobian is NaN too. A masking
# ``where`` in the forward pass hides the value but not the gradient: 0 * NaN = NaN.

SAFE = 4
MAXN = 6
W_LOG = jnp.float32(0.1)
X_LOG = jnp.full((4, 2), 3.5, jnp.float32)
D_LOG = jnp.array([0, 2, SAFE, SAFE], jnp.int32)  # depth 0 and the edge, twice
X_LOG12 = jnp.full((12, 2), 3.5, jnp.float32)
D_LOG12 = jnp.tile(D_LOG, 3)  # B > 8: "auto" goes through the scheduler's slot choice


def log_body(w):
    return lambda x: x - 1.0 + w * jnp.log(x)


def sq(x):
    return jnp.sum(x**2)


def ref_log_loss(X, w, depths):
    return sum(sq(reference_repeat(log_body(w), X[b], int(depths[b]))) for b in range(X.shape[0]))


def test_log_body_is_nan_one_step_past_the_edge():
    """The hazard is real: one step past SAFE is NaN, and a naive mask (scan over max_depth with
    ``jnp.where(i < d, f(x), x)``) under vmap leaks a NaN gradient."""
    assert finite(reference_repeat(log_body(W_LOG), X_LOG[0], SAFE))
    assert not finite(reference_repeat(log_body(W_LOG), X_LOG[0], SAFE + 1))

    def naive(x, w, d):
        def step(c, i):
            return jnp.where(i < d, log_body(w)(c), c), None

        return lax.scan(step, x, jnp.arange(MAXN))[0]

    def loss(X, w):
        return sq(jax.vmap(naive, (0, None, 0))(X, w, D_LOG))

    value, g = jax.value_and_grad(loss, argnums=(0, 1))(X_LOG, W_LOG)
    assert finite(value)
    assert not finite(g[1]), "the naive mask no longer leaks: the body lost its hazard"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nan_past_depth_values_are_finite(strategy):
    """Every strategy (``"while"`` included), unbatched with a traced depth and vmapped with
    per-sample depths: outputs are finite and equal the reference."""
    one = jax.jit(lambda x, d: dd.repeat(log_body(W_LOG), x, d, max_depth=MAXN, strategy=strategy))
    for d in (0, 2, SAFE):
        out = one(X_LOG[0], jnp.int32(d))
        assert finite(out), f"depth={d}"
        tree_allclose(out, reference_repeat(log_body(W_LOG), X_LOG[0], d))
    for X, depths in ((X_LOG, D_LOG), (X_LOG12, D_LOG12)):
        out = jax.jit(jax.vmap(one))(X, depths)
        assert finite(out)
        expected = [reference_repeat(log_body(W_LOG), X[b], int(depths[b])) for b in range(len(X))]
        tree_allclose(out, jnp.stack(expected))


NAN_GRAD_CONFIGS = [
    # "masked": the seed's scan + lax.cond. Under vmap the cond's predicate is batched, and JAX
    # (0.10) batches it by selecting the branch *operands* (stop_gradient on the branch not
    # taken) and masking each sample's cotangents with a select, so the NaN of the step not
    # taken does NOT leak into the gradient. Documented here as observed: finite.
    ("masked", None),
    ("checkpointed", None),
    ("checkpointed", 1),
    ("checkpointed", 2),
    ("auto", None),
    ("auto", 2),
]


@pytest.mark.parametrize("cfg", NAN_GRAD_CONFIGS, ids=cfg_id)
def test_nan_past_depth_gradients_are_finite(cfg):
    """Gradients w.r.t. init and the closed-over ``w``, unbatched (depth 0 and SAFE) and vmapped
    (B=4, and B=12 for the scheduler): finite and equal to the reference loop's."""
    strategy, ck = cfg
    opts = dict(max_depth=MAXN, strategy=strategy, checkpoints=ck)

    @jax.jit
    def single(x, w, d):
        return jax.grad(lambda x, w: sq(dd.repeat(log_body(w), x, d, **opts)), argnums=(0, 1))(x, w)

    for d in (0, SAFE):
        g = single(X_LOG[0], W_LOG, jnp.int32(d))
        assert finite(g), f"depth={d}: {g}"
        expected = jax.grad(
            lambda x, w, d=d: sq(reference_repeat(log_body(w), x, d)), argnums=(0, 1)
        )(X_LOG[0], W_LOG)
        tree_allclose(g, expected, **GTOL, err_msg=f"depth={d}")

    @jax.jit
    def batched(X, w, depths):
        def loss(X, w):
            return sq(jax.vmap(lambda x, d: dd.repeat(log_body(w), x, d, **opts))(X, depths))

        return jax.grad(loss, argnums=(0, 1))(X, w)

    for X, depths in ((X_LOG, D_LOG), (X_LOG12, D_LOG12)):
        g = batched(X, W_LOG, depths)
        assert finite(g), f"B={len(X)}: {g}"
        expected = jax.grad(ref_log_loss, argnums=(0, 1))(X, W_LOG, depths)
        tree_allclose(g, expected, **GTOL, err_msg=f"B={len(X)}")


@pytest.mark.parametrize(
    "checkpoints,slots",
    [
        (None, None),
        (None, 1),
        (None, 3),
        (2, None),
        (1, 2),
    ],
)
def test_nan_past_depth_repeat_batched(checkpoints, slots):
    opts = dict(max_depth=MAXN, checkpoints=checkpoints, slots=slots)

    def loss(X, w, depths):
        return sq(dd.repeat_batched(log_body(w), X, depths, **opts))

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    for X, depths in ((X_LOG, D_LOG), (X_LOG12, D_LOG12)):
        value, g = fn(X, W_LOG, depths)
        assert finite(value)
        tree_allclose(value, ref_log_loss(X, W_LOG, depths), rtol=1e-5, atol=1e-5)
        # The init gradient is masked per row and stays right in every configuration.
        expected = jax.grad(ref_log_loss, argnums=(0, 1))(X, W_LOG, depths)
        tree_allclose(g[0], expected[0], **GTOL)
        assert finite(g[1]), f"B={len(X)}: shared-parameter gradient {g[1]}"
        tree_allclose(g[1], expected[1], **GTOL)


@pytest.mark.parametrize("cfg", [("masked", None), ("checkpointed", 2), ("auto", None)], ids=cfg_id)
def test_nan_after_stop_while_loop_and_scan(cfg):
    """``while_loop`` under vmap with a per-sample stop (the step after the stop would go NaN
    for some samples) and ``scan`` whose ``ys`` would be NaN past the depth: finite values, finite
    gradients equal to the reference; ``ys`` rows past the depth are exactly 0."""
    strategy, ck = cfg
    X = jnp.array([3.5, 1.5, 0.9, 4.6], jnp.float32)[:, None] * jnp.ones((4, 2), jnp.float32)

    def cond(x):
        return x[0] > 1.0

    def wloss(X, w):
        c, n = jax.vmap(
            lambda x: dd.while_loop(
                cond,
                log_body(w),
                x,
                max_steps=8,
                strategy=strategy,
                checkpoints=ck,
                return_steps=True,
            )
        )(X)
        return sq(c), n

    (value, steps), g = jax.jit(jax.value_and_grad(wloss, argnums=(0, 1), has_aux=True))(X, W_LOG)
    np.testing.assert_array_equal(np.asarray(steps), [3, 1, 0, 5])

    def ref_wloss(X, w):
        return sum(sq(reference_while(cond, log_body(w), X[b], 8)[0]) for b in range(4))

    assert finite((value, g))
    tree_allclose(g, jax.grad(ref_wloss, argnums=(0, 1))(X, W_LOG), **GTOL)

    def scan_step(w):
        def g(c, _):
            c = log_body(w)(c)
            return c, jnp.log(c + 0.5)  # NaN one step past SAFE

        return g

    def sloss(X, w):
        c, ys = jax.vmap(
            lambda x, d: dd.scan(
                scan_step(w), x, None, depth=d, length=MAXN, strategy=strategy, checkpoints=ck
            )
        )(X, D_LOG)
        return sq(c) + jnp.sum(ys), ys

    (value, ys), g = jax.jit(jax.value_and_grad(sloss, argnums=(0, 1), has_aux=True))(X_LOG, W_LOG)
    assert finite((value, ys, g))
    for b in range(4):
        np.testing.assert_array_equal(np.asarray(ys[b, int(D_LOG[b]) :]), 0)

    def ref_sloss(X, w):
        total = 0.0
        for b in range(4):
            c, ys = reference_scan(scan_step(w), X[b], None, int(D_LOG[b]), MAXN)
            total = total + sq(c) + jnp.sum(ys)
        return total

    tree_allclose(g, jax.grad(ref_sloss, argnums=(0, 1))(X_LOG, W_LOG), **GTOL)


# A depth-0 sample whose step is NaN at its init (sqrt of a negative), beside samples that do
# run; the parameter ``w`` is shared by the batch. The depth-0 sample contributes nothing, so the
# shared gradient must be the others' and finite.
X_SQRT = jnp.array([[-1.0, -1.0], [2.0, 3.0], [1.0, 4.0], [-2.0, 0.5]], jnp.float32)
D_SQRT = jnp.array([0, 2, 3, 0], jnp.int32)
W_SQRT = jnp.float32(0.3)


def sqrt_body(w):
    return lambda x: 0.5 * x + w * jnp.sqrt(x)


def ref_sqrt_loss(X, w, depths):
    return sum(sq(reference_repeat(sqrt_body(w), X[b], int(depths[b]))) for b in range(X.shape[0]))


@pytest.mark.parametrize(
    "cfg",
    [("masked", None), ("checkpointed", None), ("checkpointed", 2), ("auto", None), ("auto", 2)],
    ids=cfg_id,
)
def test_depth0_nan_jacobian_shared_param_vmap(cfg):
    strategy, ck = cfg
    opts = dict(max_depth=4, strategy=strategy, checkpoints=ck)
    X12, D12 = jnp.tile(X_SQRT, (3, 1)), jnp.tile(D_SQRT, 3)

    @jax.jit
    def grads(X, w, depths):
        def loss(X, w):
            return sq(jax.vmap(lambda x, d: dd.repeat(sqrt_body(w), x, d, **opts))(X, depths))

        return jax.grad(loss, argnums=(0, 1))(X, w)

    for X, depths in ((X_SQRT, D_SQRT), (X12, D12)):
        g = grads(X, W_SQRT, depths)
        assert finite(g), f"B={len(X)}: {g}"
        tree_allclose(g, jax.grad(ref_sqrt_loss, argnums=(0, 1))(X, W_SQRT, depths), **GTOL)


@pytest.mark.parametrize(
    "checkpoints,slots",
    [
        (None, 1),
        (None, 2),  # exactly as many slots as samples with depth > 0: no idle slot
        (None, None),
        (None, 3),
        (2, None),
    ],
)
def test_depth0_nan_jacobian_shared_param_repeat_batched(checkpoints, slots):
    def loss(X, w):
        return sq(
            dd.repeat_batched(
                sqrt_body(w), X, D_SQRT, max_depth=4, checkpoints=checkpoints, slots=slots
            )
        )

    g = jax.jit(jax.grad(loss, argnums=(0, 1)))(X_SQRT, W_SQRT)
    expected = jax.grad(ref_sqrt_loss, argnums=(0, 1))(X_SQRT, W_SQRT, D_SQRT)
    tree_allclose(g[0], expected[0], **GTOL)
    assert finite(g[1]), f"shared-parameter gradient {g[1]}"
    tree_allclose(g[1], expected[1], **GTOL)


@pytest.mark.parametrize("at_end", [True, False], ids=["sweeps-end-together", "start-together"])
@pytest.mark.parametrize("hazard", ["log", "sqrt"])
def test_lockstep_backward_alignments(monkeypatch, at_end, hazard):
    """Both alignments of the lockstep backward pass (every carry stored): the sweeps ending
    together (slices; a sample whose sweep has not begun idles at the longest sample's inputs)
    and starting together (per-row reads, the alignment of a thinned store's units).
    Steps whose Jacobian is NaN past a sample's depth or at a never-stepped carry: the
    shared-parameter gradient is finite and equals the plain loop's, with per-sample xs and
    keys too."""
    from dyndepth import _dispatch  # noqa: PLC0415 (the decision under test)

    monkeypatch.setattr(_dispatch, "_lockstep_at_end", lambda loop: at_end)
    body, X, D, W, ref = {
        "log": (log_body, X_LOG12, D_LOG12, W_LOG, ref_log_loss),
        "sqrt": (sqrt_body, X_SQRT, D_SQRT, W_SQRT, ref_sqrt_loss),
    }[hazard]
    loss = lambda X, w: sq(dd.repeat_batched(body(w), X, D, max_depth=MAXN, slots=len(X)))  # noqa: E731
    g = jax.jit(jax.grad(loss, argnums=(0, 1)))(X, W)
    expected = jax.grad(ref, argnums=(0, 1))(X, W, D)
    assert finite(g[1]), f"shared-parameter gradient {g[1]}"
    tree_allclose(g, expected, **GTOL)

    # A scan's per-sample xs and a key per step: the same gradients as the plain loop.
    xs = jax.random.normal(jax.random.PRNGKey(3), (len(X), MAXN, X.shape[1])) * 0.01
    keys = jax.random.split(jax.random.PRNGKey(4), len(X))

    def one(x, x_seq, d, key, w, plain):
        def step(c, xi, k):
            return body(w)(c) + xi * jax.random.uniform(k), None

        if plain:
            c = x
            for j in range(int(d)):
                c = step(c, x_seq[j], dd.step_key(key, j))[0]
            return c
        return dd.scan(step, x, x_seq, depth=d, key=key, slots=len(X))[0]

    def batched(xs, w):
        return sq(jax.vmap(lambda x, s, d, k: one(x, s, d, k, w, False))(X, xs, D, keys))

    def plain(xs, w):
        return sum(sq(one(X[b], xs[b], D[b], keys[b], w, True)) for b in range(len(X)))

    g = jax.jit(jax.grad(batched, argnums=(0, 1)))(xs, W)
    assert finite(g[1]), f"shared-parameter gradient {g[1]}"
    tree_allclose(g, jax.grad(plain, argnums=(0, 1))(xs, W), **GTOL)


# ============================================================================= low precision

LP_TOL = {
    "bfloat16": dict(value=dict(rtol=3e-2, atol=3e-2), grad=dict(rtol=5e-2, atol=1e-1)),
    "float16": dict(value=dict(rtol=5e-3, atol=5e-3), grad=dict(rtol=1e-2, atol=2e-2)),
}
W_LP = jnp.asarray(np.random.default_rng(1).normal(size=(3, 3)) * 0.5, jnp.float32)
D_LP = jnp.array([0, 2, 5, 3], jnp.int32)


def as_f32(tree):
    return jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), tree)


def lp_body(W):
    """Float32 parameter, low-precision carry: the step casts W to the carry's dtype."""

    def f(x, k):
        noise = jax.random.uniform(k, x.shape, x.dtype)
        return x + 0.5 * jnp.tanh(x @ W.astype(x.dtype)) * (1 + 0.1 * noise)

    return f


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=pytest.mark.slow)])
def test_low_precision_carries(dtype):
    tol = LP_TOL[dtype]
    X = jnp.asarray(np.random.default_rng(2).normal(size=(4, 3)), dtype)
    keys = jax.random.split(jax.random.key(3), 4)
    XS = jnp.linspace(-1, 1, 5, dtype=jnp.float32).astype(dtype)

    def scan_f(W):
        def g(c, x, k):
            c = lp_body(W)(c, k) + 0.1 * x
            return c, jnp.sum(c)

        return g

    def run_all(X, W):
        out = {}
        for s in STRATEGIES:
            out[s] = jax.vmap(
                lambda x, d, k, s=s: dd.repeat(lp_body(W), x, d, max_depth=5, key=k, strategy=s)
            )(X, D_LP, keys)
            out[f"scan-{s}"] = jax.vmap(
                lambda x, d, k, s=s: dd.scan(scan_f(W), x, XS, depth=d, key=k, strategy=s)
            )(X, D_LP, keys)
        out["repeat_batched"] = dd.repeat_batched(lp_body(W), X, D_LP, max_depth=5, keys=keys)
        return out

    out = jax.jit(run_all)(X, W_LP)
    exp = jnp.stack(
        [reference_repeat(lp_body(W_LP), X[b], int(D_LP[b]), key=keys[b]) for b in range(4)]
    )
    exp_scan = [reference_scan(scan_f(W_LP), X[b], XS, int(D_LP[b]), 5, keys[b]) for b in range(4)]
    exp_scan = jax.tree_util.tree_map(lambda *r: jnp.stack(r), *exp_scan)
    for name, got in out.items():
        expected = exp_scan if name.startswith("scan") else exp
        assert all(x.dtype == jnp.dtype(dtype) for x in jax.tree_util.tree_leaves(got)), name
        # Compare in float32: numpy does not count bfloat16 as inexact, so tree_allclose would
        # ask for bitwise equality.
        tree_allclose(as_f32(got), as_f32(expected), **tol["value"], err_msg=name)

    def loss_of(name):
        def loss(X, W):
            o = run_all_one(name, X, W)
            leaves = jax.tree_util.tree_leaves(o)
            return sum(jnp.sum(x.astype(jnp.float32) ** 2) for x in leaves)

        return loss

    def run_all_one(name, X, W):
        if name == "repeat_batched":
            return dd.repeat_batched(lp_body(W), X, D_LP, max_depth=5, keys=keys, checkpoints=2)
        kind, s = name.split(":")
        if kind == "scan":
            return jax.vmap(lambda x, d, k: dd.scan(scan_f(W), x, XS, depth=d, key=k, strategy=s))(
                X, D_LP, keys
            )
        return jax.vmap(
            lambda x, d, k: dd.repeat(
                lp_body(W), x, d, max_depth=5, key=k, strategy=s, **applicable(s, 2)
            )
        )(X, D_LP, keys)

    names = [f"{k}:{s}" for k in ("repeat", "scan") for s in GRAD_STRATEGIES]
    names.append("repeat_batched")

    @jax.jit
    def all_grads(X, W):
        return {n: jax.grad(loss_of(n), argnums=(0, 1))(X, W) for n in names}

    grads = all_grads(X, W_LP)
    for name, g in grads.items():
        assert g[0].dtype == jnp.dtype(dtype) and g[1].dtype == jnp.float32, name
        assert finite(g), name
        base = grads["scan:masked"] if name.startswith("scan") else grads["repeat:masked"]
        tree_allclose(as_f32(g), as_f32(base), **tol["grad"], err_msg=name)


# ============================================================================= integer leaves


@pytest.mark.parametrize("strategy", ["masked", "checkpointed", "auto", "repeat_batched"])
def test_integer_leaves_get_no_gradient(strategy):
    """``jax.grad(..., allow_int=True)`` w.r.t. a whole carry with int and bool leaves: the int
    and bool leaves get float0 cotangents (no error), the float leaf the reference gradient,
    including when the int leaf feeds the loss through a cast."""

    def f(c):
        return {
            "x": c["x"] + jnp.tanh(c["x"]) * c["n"].astype(jnp.float32)[..., None] * 0.3,
            "n": c["n"] + 1,
            "flag": ~c["flag"],
        }

    carry = {
        "x": jnp.asarray(np.random.default_rng(4).normal(size=(4, 2)), jnp.float32),
        "n": jnp.array([0, 1, 2, 3], jnp.int32),
        "flag": jnp.array([True, False, True, False]),
    }
    depths = jnp.array([0, 3, 1, 4], jnp.int32)

    def run(c):
        if strategy == "repeat_batched":
            return dd.repeat_batched(f, c, depths, max_depth=4)
        return jax.vmap(lambda c, d: dd.repeat(f, c, d, max_depth=4, strategy=strategy))(c, depths)

    def loss(c):
        out = run(c)
        return jnp.sum(out["x"] ** 2 * out["n"].astype(jnp.float32)[:, None])

    def ref_loss(x):
        total = 0.0
        for b in range(4):
            c = {"x": x[b], "n": carry["n"][b], "flag": carry["flag"][b]}
            out = reference_repeat(f, c, int(depths[b]))
            total = total + jnp.sum(out["x"] ** 2 * out["n"].astype(jnp.float32))
        return total

    g = jax.jit(jax.grad(loss, allow_int=True))(carry)
    assert g["n"].dtype == jax.dtypes.float0 and g["n"].shape == (4,)
    assert g["flag"].dtype == jax.dtypes.float0 and g["flag"].shape == (4,)
    tree_allclose(g["x"], jax.grad(ref_loss)(carry["x"]), **GTOL)
    # Unbatched, too (one sample, its int leaf a scalar).
    one = jax.grad(
        lambda c: jnp.sum(
            dd.repeat(
                f,
                c,
                3,
                max_depth=4,
                strategy="auto" if strategy == "repeat_batched" else strategy,
            )["x"]
        ),
        allow_int=True,
    )({k: v[1] for k, v in carry.items()})
    assert one["n"].dtype == jax.dtypes.float0 and finite(one["x"])


# ============================================================================= determinism


def noisy(W):
    def f(x, k):
        keep = jax.random.bernoulli(k, 0.7, x.shape)
        return x + jnp.where(keep, jnp.tanh(x @ W), 0.0) + 0.01 * jax.random.normal(k, x.shape)

    return f


W_DET = jnp.asarray(np.random.default_rng(5).normal(size=(3, 3)) * 0.6, jnp.float32)
X_DET = jnp.asarray(np.random.default_rng(6).normal(size=(5, 3)), jnp.float32)
D_DET = jnp.array([0, 4, 6, 1, 6], jnp.int32)


def det_program(X, W, depths, keys):
    """Values of every strategy and gradients of every differentiable one, plus repeat_batched
    (scheduled, and with a checkpoint budget)."""
    out = {}
    for s in STRATEGIES:

        def run(X, W, s=s, ck=None):
            return jax.vmap(
                lambda x, d, k: dd.repeat(
                    noisy(W), x, d, max_depth=6, key=k, strategy=s, checkpoints=ck
                )
            )(X, depths, keys)

        out[s] = run(X, W)
        ck = {"masked": None, "while": None, "checkpointed": 2, "auto": None}[s]
        if s != "while":
            out[f"grad-{s}-{ck}"] = jax.grad(
                lambda X, W, s=s, ck=ck: jnp.sum(run(X, W, s, ck) ** 2), argnums=(0, 1)
            )(X, W)
    for ck, slots in ((None, None), (2, 2)):

        def rb(X, W, ck=ck, slots=slots):
            return dd.repeat_batched(
                noisy(W), X, depths, max_depth=6, keys=keys, checkpoints=ck, slots=slots
            )

        out[f"batched-{ck}-{slots}"] = rb(X, W)
        out[f"grad-batched-{ck}-{slots}"] = jax.grad(
            lambda X, W, rb=rb: jnp.sum(rb(X, W) ** 2), argnums=(0, 1)
        )(X, W)
    return out


@pytest.mark.slow
def test_bitwise_determinism_across_calls_and_fresh_jit():
    keys = jax.random.split(jax.random.key(8), 5)
    fn = jax.jit(det_program)
    first = jax.device_get(fn(X_DET, W_DET, D_DET, keys))
    tree_equal(jax.device_get(fn(X_DET, W_DET, D_DET, keys)), first, err_msg="second call")
    # A fresh jit of a new function object: traced and compiled again from scratch.
    fresh = jax.jit(lambda *a: det_program(*a))
    tree_equal(jax.device_get(fresh(X_DET, W_DET, D_DET, keys)), first, err_msg="fresh jit")
    # Equal keys give equal results; the keys matter.
    other = jax.device_get(fn(X_DET, W_DET, D_DET, jax.random.split(jax.random.key(9), 5)))
    assert not np.allclose(np.asarray(other["auto"][2]), np.asarray(first["auto"][2]))


# ============================================================================= key schedule
#
# test_keys.py records keys unbatched (repeat, scan, while_loop). Here: per-sample keys under
# vmap (each sample b sees step_key(keys[b], i)), the scheduler's slots (repeat_batched), and
# the keys the backward pass uses when it recomputes carries (checkpoints=K).

KMAX = 5
K_DEPTHS = jnp.array([0, 3, KMAX, 1, 4, 2], jnp.int32)
K_B = 6


def expected_seen(keys, depths, length=KMAX):
    rows = []
    for b in range(len(depths)):
        d = int(depths[b])
        seen = [np.asarray(jax.random.key_data(dd.step_key(keys[b], i))) for i in range(d)]
        rows.append(np.stack(seen + [np.zeros(2, np.uint32)] * (length - d)))
    return np.stack(rows)


def record(c, k):
    i, seen = c
    return i + 1, seen.at[i].set(jax.random.key_data(k))


def record_init(batch):
    return (jnp.zeros((batch,), jnp.int32), jnp.zeros((batch, KMAX, 2), jnp.uint32))


def test_per_sample_key_schedule_under_vmap_and_scheduler():
    keys = jax.random.split(jax.random.key(12), K_B)
    expected = expected_seen(keys, K_DEPTHS)

    @jax.jit
    def run(depths, keys):
        init = record_init(K_B)
        out = {}
        for s in STRATEGIES:
            out[f"repeat-{s}"] = jax.vmap(
                lambda c, d, k, s=s: dd.repeat(
                    record, c, d, max_depth=KMAX, key=k, strategy=s, **applicable(s, slots=2)
                )
            )(init, depths, keys)[1]
            out[f"scan-{s}"] = jax.vmap(
                lambda d, k, s=s: dd.scan(
                    lambda c, x, k: (c + 1, jax.random.key_data(k)),
                    jnp.int32(0),
                    None,
                    depth=d,
                    length=KMAX,
                    key=k,
                    strategy=s,
                    **applicable(s, slots=3),
                )[1]
            )(depths, keys)
            # A per-sample stop: the carry's counter reaches the sample's depth.
            out[f"while-{s}"] = jax.vmap(
                lambda c, d, k, s=s: dd.while_loop(
                    lambda st: st[0][0] < st[1],
                    lambda st, k: (record(st[0], k), st[1]),
                    (c, d),
                    max_steps=KMAX,
                    key=k,
                    strategy=s,
                )[0][1]
            )(init, depths, keys)
        for slots in (None, 1, 2, K_B):
            out[f"batched-{slots}"] = dd.repeat_batched(
                record, init, depths, max_depth=KMAX, keys=keys, slots=slots
            )[1]
        return out

    for name, seen in run(K_DEPTHS, keys).items():
        np.testing.assert_array_equal(np.asarray(seen), expected, err_msg=name)
    # Depths permuted: the keys follow the samples, not the slots.
    perm = K_DEPTHS[::-1]
    expected = expected_seen(keys, perm)
    for name, seen in run(perm, keys).items():
        np.testing.assert_array_equal(np.asarray(seen), expected, err_msg=f"permuted {name}")


@pytest.mark.parametrize(
    "cfg",
    [
        ("checkpointed", None),
        ("checkpointed", 1),
        ("checkpointed", 2),
        ("auto", None),
        ("auto", 2),
        ("repeat_batched", None),
        ("repeat_batched", 2),
    ],
    ids=cfg_id,
)
def test_backward_pass_uses_the_same_step_keys(cfg):
    """``x -> x * (1 + u_i)`` with ``u_i`` drawn from step ``i``'s key: d out / d x0 is the
    product of ``1 + u_i`` over the steps taken, computed here from ``dd.step_key`` directly. A
    backward pass (or a recomputation between checkpoints) that used other keys would differ."""
    strategy, ck = cfg
    keys = jax.random.split(jax.random.key(13), K_B)

    def f(x, k):
        return x * (1.0 + jax.random.uniform(k, x.shape))

    def loss(X):
        if strategy == "repeat_batched":
            out = dd.repeat_batched(f, X, K_DEPTHS, max_depth=KMAX, keys=keys, checkpoints=ck)
        else:
            out = jax.vmap(
                lambda x, d, k: dd.repeat(
                    f, x, d, max_depth=KMAX, key=k, strategy=strategy, checkpoints=ck
                )
            )(X, K_DEPTHS, keys)
        return jnp.sum(out)

    g = jax.jit(jax.grad(loss))(jnp.ones((K_B, 2), jnp.float32))
    expected = []
    for b in range(K_B):
        prod = np.ones(2, np.float32)
        for i in range(int(K_DEPTHS[b])):
            prod = prod * (1.0 + np.asarray(jax.random.uniform(dd.step_key(keys[b], i), (2,))))
        expected.append(prod)
    np.testing.assert_allclose(np.asarray(g), np.stack(expected), rtol=1e-6)


# ============================================================================= no recompilation
#
# test_repeat_cost.py::test_no_recompile_for_new_depths covers the forward pass of ``repeat``.
# Here: jitted value_and_grad (vmapped, per-sample and shared depths; B > 8 so that "auto" runs
# the scheduler's run-time slot choice), repeat_batched forward and value_and_grad, and scan.


def tanh_step(W):
    return lambda x: x + jnp.tanh(x @ W)


def test_no_retrace_for_new_depths_under_grad():
    B, M = 10, 6
    X = jnp.asarray(np.random.default_rng(7).normal(size=(B, 3)), jnp.float32)
    traces = {}

    def counted(name, fn):
        traces[name] = 0

        def wrapped(*a):
            traces[name] += 1
            return fn(*a)

        return jax.jit(wrapped)

    def vmapped(strategy, depths_axis):
        def loss(X, W, depths):
            out = jax.vmap(
                lambda x, d: dd.repeat(tanh_step(W), x, d, max_depth=M, strategy=strategy),
                in_axes=(0, depths_axis),
            )(X, depths)
            return jnp.sum(out**2)

        return jax.value_and_grad(loss, argnums=(0, 1))

    def batched_fwd(X, W, depths):
        return dd.repeat_batched(tanh_step(W), X, depths, max_depth=M)

    def batched_vg(X, W, depths):
        return jax.value_and_grad(
            lambda X, W: jnp.sum(batched_fwd(X, W, depths) ** 2), argnums=(0, 1)
        )(X, W)

    def scan_vg(X, W, depths):
        def loss(X, W):
            c, ys = jax.vmap(
                lambda x, d: dd.scan(
                    lambda c, _: (tanh_step(W)(c), jnp.sum(c)), x, None, depth=d, length=M
                )
            )(X, depths)
            return jnp.sum(c**2) + jnp.sum(ys)

        return jax.value_and_grad(loss, argnums=(0, 1))(X, W)

    per_sample = {
        "vg-checkpointed": counted("vg-checkpointed", vmapped("checkpointed", 0)),
        "vg-auto": counted("vg-auto", vmapped("auto", 0)),
        "batched-fwd": counted("batched-fwd", batched_fwd),
        "batched-vg": counted("batched-vg", batched_vg),
        "scan-vg": counted("scan-vg", scan_vg),
    }
    shared = {
        "vg-auto-shared": counted("vg-auto-shared", vmapped("auto", None)),
        "vg-checkpointed-shared": counted("vg-checkpointed-shared", vmapped("checkpointed", None)),
    }
    rng = np.random.default_rng(8)
    vectors = [np.zeros(B), np.full(B, M), rng.integers(0, M + 1, B), rng.integers(0, 2, B)]
    for depths in vectors:
        depths = jnp.asarray(depths, jnp.int32)
        for fn in per_sample.values():
            jax.block_until_ready(fn(X, W_DET, depths))
    for d in (0, M, 3):
        for fn in shared.values():
            jax.block_until_ready(fn(X, W_DET, jnp.int32(d)))
    assert traces == {name: 1 for name in traces}, traces
    # And the last results are right (one spot check against the reference).
    d = jnp.int32(3)
    value, _ = shared["vg-auto-shared"](X, W_DET, d)
    expected = sum(jnp.sum(reference_repeat(tanh_step(W_DET), X[b], 3) ** 2) for b in range(B))
    tree_allclose(value, expected, rtol=1e-5, atol=1e-4)
