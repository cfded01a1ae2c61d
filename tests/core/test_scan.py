"""Tests for ``dyndepth.scan`` against plain-Python references: values and per-step outputs,
per-sample depths under ``vmap``, gradients, no ``xs``, length zero, and the argument errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import expect_errors, reference_scan, tree_allclose, tree_equal
from loop_setup import GTOL, KEY, KEYS, KINDS, W0, X0, XB, B, D, cached
from shared_lists import MID_GRAD_CONFIGS, STRATEGIES, cfg_id

import dyndepth as dd

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
