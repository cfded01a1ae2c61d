"""Tests for ``dyndepth.repeat`` against plain-Python references: values (concrete, traced and
per-sample depths, out-of-range depths clamped), the seed's method, integer and bool leaves in the
carry, and the argument errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import expect_errors, reference_repeat, seed_method, tree_allclose, tree_equal
from loop_setup import (
    DEPTHS,
    GTOL,
    KEY,
    KEYS,
    KINDS,
    MAX,
    W0,
    X0,
    XB,
    B,
    cached,
    dropout_layer,
    ref,
    ref_batch,
    run,
)
from shared_lists import STRATEGIES

import dyndepth as dd

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
