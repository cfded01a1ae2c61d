"""Tests for ``dyndepth.while_loop`` against ``lax.while_loop`` and a scan + cond reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    expect_errors,
    reference_repeat,
    reference_while,
    reference_while_scan,
    tree_allclose,
    tree_equal,
)
from jax import lax
from shared_lists import FULL, MID_GRAD_CONFIGS, SHORT_GRAD_CONFIGS, STRATEGIES, cfg_id

import dyndepth as dd

D = 3
B = 4
MAX_STEPS = 8
W0 = jax.random.normal(jax.random.PRNGKey(10), (D, D)) * 0.3
X0 = jax.random.normal(jax.random.PRNGKey(11), (D,)) * 2.0
# Different scales, so that a data-dependent stop happens at different steps per sample.
XB = jax.random.normal(jax.random.PRNGKey(12), (B, D)) * jnp.array([[0.3], [1.0], [3.0], [6.0]])

GTOL = dict(rtol=1e-5, atol=1e-4)


_CACHE: dict = {}


def cached(name, thunk):
    """Compute a reference once and reuse it across the parametrized cases."""
    if name not in _CACHE:
        _CACHE[name] = jax.device_get(thunk())
    return _CACHE[name]


# ----------------------------------------------------------------------------- problems


def fixed_cond(c):
    return c[0] < 4


def fixed_body(W):
    def body(c):
        i, x = c
        return i + 1, x + jnp.tanh(W @ x)

    return body


def grow_cond(x):
    return jnp.linalg.norm(x) < 10.0


def grow_body(W):
    def body(x):
        return x * 1.3 + W @ x

    return body


def fixed_init(x):
    return (jnp.int32(0), x)


def steps_taken(cond, body, init):
    return reference_while(cond, body, init, MAX_STEPS)[1]


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fixed_trip_count(strategy):
    init = fixed_init(X0)
    out, steps = dd.while_loop(
        fixed_cond, fixed_body(W0), init, max_steps=MAX_STEPS, strategy=strategy, return_steps=True
    )
    tree_allclose(out, lax.while_loop(fixed_cond, fixed_body(W0), init), err_msg="lax.while_loop")
    tree_allclose(out, reference_while(fixed_cond, fixed_body(W0), init, MAX_STEPS)[0])
    assert steps.dtype == jnp.int32 and steps.shape == () and int(steps) == 4
    jitted = jax.jit(
        lambda x: dd.while_loop(
            fixed_cond, fixed_body(W0), fixed_init(x), max_steps=MAX_STEPS, strategy=strategy
        )
    )
    tree_allclose(jitted(X0), out, err_msg="jit")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_data_dependent_stop(strategy):
    n_ref = steps_taken(grow_cond, grow_body(W0), X0)
    assert 1 <= n_ref < MAX_STEPS, "the test problem must stop on its own, after a step or more"
    fn = jax.jit(
        lambda x, W: dd.while_loop(
            grow_cond, grow_body(W), x, max_steps=MAX_STEPS, strategy=strategy, return_steps=True
        )
    )
    out, steps = fn(X0, W0)
    assert int(steps) == n_ref
    tree_allclose(out, lax.while_loop(grow_cond, grow_body(W0), X0), err_msg="lax.while_loop")
    tree_allclose(
        (out, steps),
        reference_while_scan(grow_cond, grow_body(W0), X0, MAX_STEPS),
        err_msg="scan + cond",
    )
    assert float(jnp.linalg.norm(out)) >= 10.0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_truncated_at_max_steps(strategy):
    def always(x):
        return jnp.all(jnp.isfinite(x))

    out, steps = jax.jit(
        lambda x: dd.while_loop(
            always, grow_body(W0), x, max_steps=MAX_STEPS, strategy=strategy, return_steps=True
        )
    )(X0)
    assert int(steps) == MAX_STEPS
    tree_allclose(out, reference_repeat(grow_body(W0), X0, MAX_STEPS))
    tree_allclose(out, reference_while_scan(always, grow_body(W0), X0, MAX_STEPS)[0])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_step_when_max_steps_zero_or_cond_false_at_start(strategy):
    out, steps = dd.while_loop(
        grow_cond, grow_body(W0), X0, max_steps=0, strategy=strategy, return_steps=True
    )
    tree_equal(out, X0)
    assert int(steps) == 0
    big = X0 / jnp.linalg.norm(X0) * 20.0
    out, steps = dd.while_loop(
        grow_cond, grow_body(W0), big, max_steps=MAX_STEPS, strategy=strategy, return_steps=True
    )
    tree_equal(out, big)
    assert int(steps) == 0
    if strategy != "while":
        for x, max_steps in ((X0, 0), (big, MAX_STEPS)):
            g = jax.grad(
                lambda x, m=max_steps: jnp.sum(
                    dd.while_loop(grow_cond, grow_body(W0), x, max_steps=m, strategy=strategy)
                )
            )(x)
            tree_equal(g, jnp.ones_like(x), err_msg=f"max_steps={max_steps}")


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("cfg", MID_GRAD_CONFIGS, ids=cfg_id)
def test_gradients_match_scan_reference(cfg):
    strategy, ckpt = cfg

    def grow_loss(x, W, fn):
        return jnp.sum(fn(grow_cond, grow_body(W), x) ** 2)

    def fixed_loss(x, W, fn):
        return jnp.sum(fn(fixed_cond, fixed_body(W), fixed_init(x))[1] ** 2)

    def dd_fn(c, b, init):
        return dd.while_loop(c, b, init, max_steps=MAX_STEPS, strategy=strategy, checkpoints=ckpt)

    def ref_fn(c, b, init):
        return reference_while_scan(c, b, init, MAX_STEPS)[0]

    def eager_fn(c, b, init):
        return reference_while(c, b, init, MAX_STEPS)[0]

    for name, loss in (("grow", grow_loss), ("fixed", fixed_loss)):
        g = jax.jit(jax.grad(lambda x, W, loss=loss: loss(x, W, dd_fn), argnums=(0, 1)))(X0, W0)
        g_scan = cached(
            ("grad-scan", name),
            lambda loss=loss: jax.grad(lambda x, W: loss(x, W, ref_fn), argnums=(0, 1))(X0, W0),
        )
        g_eager = cached(
            ("grad-eager", name),
            lambda loss=loss: jax.grad(lambda x, W: loss(x, W, eager_fn), argnums=(0, 1))(X0, W0),
        )
        # Gradients of the growing problem reach ~100: compare relative to that.
        tol = dict(rtol=2e-5, atol=1e-3) if name == "grow" else GTOL
        tree_allclose(g, g_scan, **tol, err_msg=f"{name}: vs scan + cond")
        tree_allclose(g, g_eager, **tol, err_msg=f"{name}: vs eager loop")


def _jacrev(strategy, ckpt, argnum):
    def f(x, W):
        return dd.while_loop(
            grow_cond, grow_body(W), x, max_steps=MAX_STEPS, strategy=strategy, checkpoints=ckpt
        )

    jac = jax.jit(jax.jacrev(f, argnums=argnum))(X0, W0)
    expected = cached(
        ("jacrev", argnum),
        lambda: jax.jacrev(
            lambda x, W: reference_while(grow_cond, grow_body(W), x, MAX_STEPS)[0], argnums=argnum
        )(X0, W0),
    )
    return jac, expected


@pytest.mark.parametrize("cfg", SHORT_GRAD_CONFIGS, ids=cfg_id)
def test_jacrev_wrt_init(cfg):
    jac, expected = _jacrev(*cfg, argnum=0)
    tree_allclose(jac, expected, rtol=2e-5, atol=1e-3)


@pytest.mark.parametrize("cfg", SHORT_GRAD_CONFIGS, ids=cfg_id)
def test_jacrev_wrt_closed_over_params(cfg):
    """Regression: every row of the Jacobian w.r.t. a closed-over parameter used to come out as
    the sum of all rows (see test_repeat_autodiff.test_jacrev_unbatched_wrt_closed_over_param)."""
    jac, expected = _jacrev(*cfg, argnum=1)
    tree_allclose(jac, expected, rtol=2e-5, atol=1e-3)


@pytest.mark.parametrize("strategy", ["masked", "while"])
def test_jvp_and_jacfwd(strategy):
    def f(x, W):
        return dd.while_loop(grow_cond, grow_body(W), x, max_steps=MAX_STEPS, strategy=strategy)

    def ref_f(x, W):
        return reference_while(grow_cond, grow_body(W), x, MAX_STEPS)[0]

    tangents = (jnp.ones((D,)), jnp.eye(D) * 0.1)
    tree_allclose(
        jax.jvp(f, (X0, W0), tangents), jax.jvp(ref_f, (X0, W0), tangents), rtol=2e-5, atol=1e-3
    )
    tree_allclose(
        jax.jit(jax.jacfwd(f, argnums=(0, 1)))(X0, W0),
        jax.jacfwd(ref_f, argnums=(0, 1))(X0, W0),
        rtol=2e-5,
        atol=1e-3,
    )


def test_while_strategy_rejects_reverse_mode():
    def f(x):
        return jnp.sum(
            dd.while_loop(grow_cond, grow_body(W0), x, max_steps=MAX_STEPS, strategy="while")
        )

    with pytest.raises(TypeError, match="checkpointed"):
        jax.grad(f)(X0)
    with pytest.raises(TypeError, match="checkpointed"):
        jax.grad(lambda X: jnp.sum(jax.vmap(f)(X)))(XB)


@pytest.mark.parametrize("cfg", SHORT_GRAD_CONFIGS, ids=cfg_id)
def test_identity_body_gives_exact_gradients(cfg):
    """A body that does not touch x: d sum(out) / d x is exactly ones; a closed-over parameter
    the body never uses (or uses with weight 0) gets exactly zero."""
    strategy, ckpt = cfg
    V = jnp.ones((D, D))

    def make_body(variant, V):
        def body(c):
            x = c[0] if variant == "unused" else c[0] + 0.0 * jnp.sum(V)
            return x, c[1] + 1

        return body

    def loss(x, V, variant):
        out = dd.while_loop(
            lambda c: c[1] < 5,
            make_body(variant, V),
            (x, jnp.int32(0)),
            max_steps=MAX_STEPS,
            strategy=strategy,
            checkpoints=ckpt,
        )
        return jnp.sum(out[0])

    for variant in ("unused", "zero-weight"):
        gx, gV = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(X0, V, variant)
        tree_equal(gx, jnp.ones_like(X0), err_msg=variant)
        tree_equal(gV, jnp.zeros_like(V), err_msg=variant)
    gX, gV = jax.grad(
        lambda X, V: jnp.sum(jax.vmap(loss, (0, None, None))(X, V, "zero-weight")), (0, 1)
    )(XB, V)
    tree_equal(gX, jnp.ones_like(XB), err_msg="vmap")
    tree_equal(gV, jnp.zeros_like(V), err_msg="vmap")


# ----------------------------------------------------------------------------- vmap


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_vmap_with_unbatched_predicate(strategy):
    """The predicate reads only an unbatched counter: the whole batch stops at the same step."""

    def f(x, W):
        return dd.while_loop(
            fixed_cond,
            fixed_body(W),
            (jnp.int32(0), x),
            max_steps=MAX_STEPS,
            strategy=strategy,
            return_steps=True,
        )

    (i, out), steps = jax.jit(jax.vmap(f, in_axes=(0, None)))(XB, W0)
    expected = jax.vmap(lambda x: lax.while_loop(fixed_cond, fixed_body(W0), (0, x))[1])(XB)
    tree_allclose(out, expected)
    np.testing.assert_array_equal(np.asarray(steps), 4)
    np.testing.assert_array_equal(np.asarray(i), 4)
    if strategy != "while":

        def loss(X, W):
            return jnp.sum(jax.vmap(f, in_axes=(0, None))(X, W)[0][1] ** 2)

        def ref_loss(X, W):
            return sum(
                jnp.sum(
                    reference_while(fixed_cond, fixed_body(W), fixed_init(X[b]), MAX_STEPS)[0][1]
                    ** 2
                )
                for b in range(B)
            )

        tree_allclose(
            jax.grad(loss, argnums=(0, 1))(XB, W0),
            jax.grad(ref_loss, argnums=(0, 1))(XB, W0),
            **GTOL,
        )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_vmap_with_per_sample_predicate(strategy):
    """Each sample stops at its own step: a data-dependent predicate with per-sample thresholds."""
    thresholds = jnp.array([10.0, 6.0, 10.0, 20.0])

    def f(x, t, W):
        return dd.while_loop(
            lambda c: jnp.linalg.norm(c) < t,
            grow_body(W),
            x,
            max_steps=MAX_STEPS,
            strategy=strategy,
            return_steps=True,
        )

    out, steps = jax.jit(jax.vmap(f, in_axes=(0, 0, None)))(XB, thresholds, W0)
    expected = [
        reference_while(
            lambda c, b=b: jnp.linalg.norm(c) < thresholds[b], grow_body(W0), XB[b], MAX_STEPS
        )
        for b in range(B)
    ]
    assert steps.shape == (B,) and steps.dtype == jnp.int32
    assert [int(s) for s in steps] == [n for _, n in expected]
    assert len(set(int(s) for s in steps)) == B, "the samples should stop at different steps"
    assert MAX_STEPS in [int(s) for s in steps], "one sample should be truncated at max_steps"
    tree_allclose(out, jnp.stack([c for c, _ in expected]))
    lax_out = jax.vmap(
        lambda x, t: lax.while_loop(lambda c: jnp.linalg.norm(c) < t, grow_body(W0), x)
    )(XB, thresholds)
    # lax.while_loop has no max_steps; it agrees on the samples that stop before it.
    for b in range(B):
        if expected[b][1] < MAX_STEPS:
            tree_allclose(out[b], lax_out[b], err_msg=f"sample {b}")
    if strategy != "while":

        def loss(X, W):
            return jnp.sum(jax.vmap(f, in_axes=(0, 0, None))(X, thresholds, W)[0] ** 2)

        def ref_loss(X, W):
            return jnp.sum(
                jax.vmap(
                    lambda x, t: reference_while_scan(
                        lambda c: jnp.linalg.norm(c) < t, grow_body(W), x, MAX_STEPS
                    )[0]
                )(X, thresholds)
                ** 2
            )

        tree_allclose(
            jax.jit(jax.grad(loss, argnums=(0, 1)))(XB, W0),
            cached(("per-sample-pred",), lambda: jax.grad(ref_loss, argnums=(0, 1))(XB, W0)),
            rtol=2e-5,
            atol=1e-3,
        )


@pytest.mark.parametrize("cfg", [("checkpointed", None), ("auto", 2)], ids=cfg_id)
def test_vmap_of_grad_per_sample_stop_shared_params(cfg):
    """vmap(grad): each sample's own gradient of W shared by the batch (in_axes=None)."""
    strategy, ckpt = cfg

    def loss(x, W):
        out = dd.while_loop(
            grow_cond, grow_body(W), x, max_steps=MAX_STEPS, strategy=strategy, checkpoints=ckpt
        )
        return jnp.sum(out**2)

    gx, gW = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None)))(XB, W0)

    def ref_loss(x, W):
        return jnp.sum(reference_while(grow_cond, grow_body(W), x, MAX_STEPS)[0] ** 2)

    for b in range(B):
        expected = cached(
            ("vmap-of-grad", b), lambda b=b: jax.grad(ref_loss, argnums=(0, 1))(XB[b], W0)
        )
        tree_allclose((gx[b], gW[b]), expected, rtol=2e-5, atol=1e-3, err_msg=f"sample {b}")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nested_while_loops_per_sample_bounds(strategy):
    outer_n = jnp.array([0, 2, 3, 1], jnp.int32)
    inner_n = jnp.array([3, 0, 2, 4], jnp.int32)

    def net(x, W, a, b):
        def inner_body(cc):
            j, z = cc
            return j + 1, jnp.tanh(W @ z) + 0.5 * z

        def outer_body(c):
            i, z = c
            _, z = dd.while_loop(
                lambda cc: cc[0] < b, inner_body, (jnp.int32(0), z), max_steps=4, strategy=strategy
            )
            return i + 1, z

        return dd.while_loop(
            lambda c: c[0] < a, outer_body, (jnp.int32(0), x), max_steps=4, strategy=strategy
        )[1]

    def ref_net(x, W, a, b):
        for _ in range(a):
            for _ in range(b):
                x = jnp.tanh(W @ x) + 0.5 * x
        return x

    out = jax.jit(jax.vmap(net, in_axes=(0, None, 0, 0)))(XB, W0, outer_n, inner_n)
    expected = jnp.stack(
        [ref_net(XB[b], W0, int(outer_n[b]), int(inner_n[b])) for b in range(B)],
    )
    tree_allclose(out, expected)
    if strategy != "while":

        def loss(X, W):
            return jnp.sum(jax.vmap(net, in_axes=(0, None, 0, 0))(X, W, outer_n, inner_n) ** 2)

        def ref_loss(X, W):
            return sum(
                jnp.sum(ref_net(X[b], W, int(outer_n[b]), int(inner_n[b])) ** 2) for b in range(B)
            )

        tree_allclose(
            jax.jit(jax.grad(loss, argnums=(0, 1)))(XB, W0),
            jax.grad(ref_loss, argnums=(0, 1))(XB, W0),
            **GTOL,
        )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_carry_with_int_zero_size_and_none_leaves(strategy):
    def body(c):
        return {
            "x": c["x"] * 1.1 + 0.1,
            "i": c["i"] + 1,
            "flag": jnp.logical_not(c["flag"]),
            "empty": c["empty"] * 2.0 + 1.0,
            "none": None,
        }

    def init(x):
        return {
            "x": x,
            "i": jnp.int32(0),
            "flag": jnp.array(False),
            "empty": jnp.zeros((0, 2)),
            "none": None,
        }

    def cond(c):
        return c["i"] < 3

    def f(x):
        return dd.while_loop(cond, body, init(x), max_steps=MAX_STEPS, strategy=strategy)

    out = jax.jit(jax.vmap(f))(XB)
    assert out["none"] is None
    assert out["empty"].shape == (B, 0, 2) and out["empty"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out["i"]), 3)
    np.testing.assert_array_equal(np.asarray(out["flag"]), True)
    tree_allclose(
        out["x"], jax.vmap(lambda x: reference_while(cond, body, init(x), MAX_STEPS)[0]["x"])(XB)
    )
    tree_allclose(f(X0), reference_while(cond, body, init(X0), MAX_STEPS)[0])
    if strategy != "while":
        g = jax.grad(lambda X: jnp.sum(jax.vmap(f)(X)["x"]))(XB)
        tree_allclose(g, jnp.full_like(XB, 1.1**3))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_disable_jit(strategy):
    with jax.disable_jit():
        out, steps = dd.while_loop(
            grow_cond, grow_body(W0), X0, max_steps=MAX_STEPS, strategy=strategy, return_steps=True
        )
        expected, n = reference_while(grow_cond, grow_body(W0), X0, MAX_STEPS)
        assert int(steps) == n
        tree_allclose(out, expected)
        if strategy != "while":
            g = jax.grad(
                lambda x: jnp.sum(
                    dd.while_loop(
                        grow_cond, grow_body(W0), x, max_steps=MAX_STEPS, strategy=strategy
                    )
                )
            )(X0)
            g_ref = jax.grad(
                lambda x: jnp.sum(reference_while(grow_cond, grow_body(W0), x, MAX_STEPS)[0])
            )(X0)
            tree_allclose(g, g_ref, rtol=2e-5, atol=1e-3)


# ----------------------------------------------------------------------------- errors


def _body(x):
    return x


WHILE_ERRORS = {
    "cond-returns-float": (
        dict(cond_fun=lambda x: jnp.sum(x)),
        TypeError,
        r"`cond_fun` must return a boolean scalar, got float32\[\]",
    ),
    "cond-returns-int": (
        dict(cond_fun=lambda x: jnp.int32(1)),
        TypeError,
        r"`cond_fun` must return a boolean scalar, got int32\[\]",
    ),
    "cond-returns-vector": (
        dict(cond_fun=lambda x: x > 0),
        TypeError,
        r"`cond_fun` must return a boolean scalar, got bool\[3\]",
    ),
    "cond-returns-pair": (
        dict(cond_fun=lambda x: (x[0] > 0, x[1] > 0)),
        TypeError,
        r"`cond_fun` must return a boolean scalar",
    ),
    "cond-not-callable": (dict(cond_fun=True), TypeError, r"`cond_fun` must be callable"),
    "priority-not-callable": (dict(priority=3), TypeError, r"`priority` must be callable"),
    "priority-returns-bool": (
        dict(priority=lambda x: x[0] > 0),
        TypeError,
        r"`priority` must return a real scalar \(an int or float\), got bool\[\]",
    ),
    "priority-returns-vector": (
        dict(priority=lambda x: x),
        TypeError,
        r"`priority` must return a real scalar.*got float32\[3\]; under vmap, write it for one",
    ),
    "body-not-callable": (dict(body_fun=None), TypeError, r"`body_fun` must be callable"),
    "body-changes-dtype": (
        dict(body_fun=lambda x: x.astype(jnp.int32)),
        TypeError,
        r"`body_fun` must keep the shape and dtype.*int32",
    ),
    "max_steps-negative": (dict(max_steps=-1), ValueError, r"`max_steps` must be >= 0"),
    "max_steps-float": (dict(max_steps=2.0), TypeError, r"`max_steps` must be a static Python int"),
    "max_steps-bool": (dict(max_steps=True), TypeError, r"`max_steps`.*bool"),
    "max_steps-array": (
        dict(max_steps=jnp.int32(3)),
        TypeError,
        r"`max_steps` must be a static Python int",
    ),
    "checkpoints-zero": (dict(checkpoints=0), ValueError, r"`checkpoints` must be >= 1"),
    "strategy-unknown": (dict(strategy="scan"), ValueError, r"`strategy` must be one of"),
    "key-not-a-key": (
        dict(body_fun=lambda x, k: x, key=jnp.ones(2)),
        TypeError,
        r"`key` must be a PRNG key",
    ),
}


def _call_while(overrides):
    kwargs = dict(cond_fun=grow_cond, body_fun=_body, init=X0, max_steps=MAX_STEPS)
    kwargs.update(overrides)
    cond_fun, body_fun, init = kwargs.pop("cond_fun"), kwargs.pop("body_fun"), kwargs.pop("init")
    dd.while_loop(cond_fun, body_fun, init, **kwargs)


WHILE_ERROR_GROUPS = sorted({name.split("-")[0] for name in WHILE_ERRORS})


@pytest.mark.parametrize("group", WHILE_ERROR_GROUPS)
def test_while_loop_errors(group):
    names = [n for n in WHILE_ERRORS if n.split("-")[0] == group]
    expect_errors(WHILE_ERRORS, names, _call_while)


def test_cond_fun_error_under_vmap_points_to_per_sample_form():
    with pytest.raises(TypeError, match=r"`cond_fun`.*under vmap, write it for one sample"):
        jax.vmap(
            lambda x: dd.while_loop(lambda c: c > 0, _body, x, max_steps=MAX_STEPS), in_axes=0
        )(XB)


def _counting(limits):
    """A loop that counts up to its sample's limit: the steps taken are the limits (capped)."""
    return (
        (lambda c: c[0] < c[1]),
        (lambda c: c.at[0].add(1.0)),
        jnp.stack([jnp.zeros_like(limits), limits], axis=-1),
    )


@pytest.mark.parametrize("strategy", ["while", "checkpointed", "auto"])
def test_return_stats_unbatched_counts_the_steps(strategy):
    for limit in (0.0, 1.0, 5.0, 20.0):
        cond, body, init = _counting(jnp.asarray(limit))
        _, steps, stats = dd.while_loop(cond, body, init, max_steps=MAX_STEPS, strategy=strategy,
                                        return_steps=True, return_stats=True)  # fmt: skip
        assert int(steps) == min(int(limit), MAX_STEPS)
        assert int(stats["iterations"]) == int(stats["executed_sample_steps"]) == int(steps)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    ("strategy", "slots"), [("auto", 1), ("auto", 3), ("auto", None), ("checkpointed", None)]
)
def test_return_stats_under_vmap_describe_the_batch_loop(seed, strategy, slots):
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(2, 12))
    limits = jnp.asarray(rng.integers(0, MAX_STEPS + 3, rows), jnp.float32)
    cond, body, init = _counting(limits)
    kw = dict(max_steps=MAX_STEPS, strategy=strategy, return_steps=True, return_stats=True)
    if slots is not None:
        kw["slots"] = slots

    out, steps, stats = jax.jit(jax.vmap(lambda c: dd.while_loop(cond, body, c, **kw)))(init)
    want = np.minimum(np.asarray(limits), MAX_STEPS)
    np.testing.assert_array_equal(np.asarray(steps), want)
    np.testing.assert_array_equal(np.asarray(out[:, 0]), want)
    its, executed = np.asarray(stats["iterations"]), np.asarray(stats["executed_sample_steps"])
    assert (its == its[0]).all() and (executed == executed[0]).all()  # one loop, its figures
    its, executed = int(its[0]), int(executed[0])
    assert its >= want.max() and executed >= want.sum()
    if strategy == "checkpointed":  # lockstep: the longest sample's steps, every row each
        assert (its, executed) == (want.max(), rows * want.max())
    elif slots is not None:  # continuous batching in `slots` rows (all of them at most)
        assert executed == min(slots, rows) * its
        if slots == 1:  # one slot runs the steps one after another
            assert its == executed == want.sum()


def test_return_stats_refuses_the_masked_loop():
    cond, body, init = _counting(jnp.asarray(3.0))
    with pytest.raises(ValueError, match="`return_stats`=True reports the work.*masked"):
        dd.while_loop(cond, body, init, max_steps=MAX_STEPS, strategy="masked", return_stats=True)


def test_return_stats_keeps_gradients():
    def loss(scale, strategy):
        def body(c):
            return c * jnp.asarray([1.0, scale]) + jnp.asarray([1.0, 0.0])

        stats = strategy != "masked"
        out = dd.while_loop(lambda c: c[0] < 3.0, body, jnp.asarray([0.0, 1.0]),
                            max_steps=MAX_STEPS, strategy=strategy, return_stats=stats)  # fmt: skip
        return (out[0] if stats else out)[1]

    want = jax.grad(loss)(1.5, "masked")
    for strategy in ("checkpointed", "auto"):
        np.testing.assert_allclose(jax.grad(loss)(1.5, strategy), want, rtol=1e-6)


def _queue_iterations(steps, priority, slots):
    """Continuous batching in plain Python: the samples with steps queue by decreasing
    priority (NaN lowest, ties in batch order); each iteration steps every busy slot, and a
    slot whose sample is done takes the next queued sample, freed slots in slot order. The
    loop's iterations: when its last slot runs out of work."""
    key = [(-(-np.inf if np.isnan(p) else p), b) for b, p in enumerate(priority)]
    queue = [b for _, b in sorted(key) if steps[b] > 0]
    free_at = [0] * slots  # the iteration at which each slot is next free
    for b in queue:  # the slot free first takes the next sample (lowest index among equals)
        s = min(range(slots), key=lambda j: (free_at[j], j))
        free_at[s] += steps[b]
    return max(free_at)


@pytest.mark.parametrize("seed", range(6 if FULL else 3))
def test_priority_orders_the_queue_and_changes_no_result(seed):
    """Random stopping steps and priorities (ints or floats, ties, NaNs): with ``priority``
    the outputs, steps and gradients equal those without, and the loop's iterations are those
    of continuous batching in the priority's order (a plain-Python simulation)."""
    rng = np.random.default_rng(seed)
    rows, slots = int(rng.integers(4, 20)), int(rng.integers(1, 5))
    limits = rng.integers(0, MAX_STEPS + 2, rows).astype(np.float32)
    as_int = seed % 2 == 1  # integer priorities with many ties, or floats with some NaNs
    if as_int:
        prio = rng.integers(0, 4, rows).astype(np.float32)
    else:
        prio = np.where(rng.random(rows) < 0.2, np.nan, rng.normal(size=rows)).astype(np.float32)
    cond, body, init = _counting(jnp.asarray(limits))
    init = jnp.concatenate([init, jnp.asarray(prio)[:, None]], axis=1)

    def run(scale, priority):
        def one(c):
            return dd.while_loop(cond, lambda c: body(c) * jnp.asarray([1.0, 1.0, scale]), c,
                                 max_steps=MAX_STEPS, slots=slots, priority=priority,
                                 return_steps=True, return_stats=True)  # fmt: skip

        return jax.vmap(one)(init)

    by_last = (lambda c: c[2].astype(jnp.int32)) if as_int else (lambda c: c[2])  # noqa: E731
    (out, steps, stats), (out0, steps0, _) = run(1.5, by_last), run(1.5, None)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out0))
    np.testing.assert_array_equal(np.asarray(steps), np.asarray(steps0))
    want_steps = np.minimum(limits, MAX_STEPS).astype(int)
    want = _queue_iterations(want_steps, prio, min(slots, rows))
    assert int(stats["iterations"][0]) == want, (want_steps, prio, slots)
    grads = [jax.grad(lambda s, p=p: jnp.sum(run(s, p)[0] ** 2))(1.5) for p in (by_last, None)]
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-6)

    def per_sample_grads(priority):  # vmap(grad): each sample's gradient, a batched backward
        def loss(scale, c):
            out = dd.while_loop(cond, lambda c: body(c) * jnp.asarray([1.0, 1.0, scale]), c,
                                max_steps=MAX_STEPS, slots=slots, priority=priority)  # fmt: skip
            return jnp.sum(out**2)

        return jax.vmap(jax.grad(loss), in_axes=(None, 0))(1.5, init)

    np.testing.assert_allclose(per_sample_grads(by_last), per_sample_grads(None), rtol=1e-6)


def test_priority_longest_first_shortens_the_tail():
    """One long sample behind fifteen short ones: started first, the batch takes its steps
    (20 iterations) instead of the short ones' turns plus its steps."""
    limits = jnp.asarray([1.0] * 15 + [20.0])
    cond, body, init = _counting(limits)

    def iterations(priority):
        def one(c):
            return dd.while_loop(cond, body, c, max_steps=32, slots=4, priority=priority,
                                 return_stats=True)[1]  # fmt: skip

        return int(jax.vmap(one)(init)["iterations"][0])

    assert iterations(None) == 4 + 20 - 1
    assert iterations(lambda c: c[1]) == 20
