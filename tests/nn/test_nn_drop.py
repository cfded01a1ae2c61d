"""Tests for ``dyndepth.nn.drop_path``, ``stochastic_residual`` and ``layer_drop``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Counter, tree_allclose

import dyndepth.nn as dnn

B, D, L = 6, 3, 5
X = jax.random.normal(jax.random.PRNGKey(0), (B, D))
W = jax.random.normal(jax.random.PRNGKey(1), (D, D)) * 0.5
PARAMS = {
    "w": jax.random.normal(jax.random.PRNGKey(2), (L, D, D)) * 0.5,
    "b": jax.random.normal(jax.random.PRNGKey(3), (L, D)) * 0.1,
}
KEY = jax.random.PRNGKey(4)
KEYS = jax.random.split(jax.random.PRNGKey(5), 8)
GTOL = dict(rtol=1e-5, atol=1e-5)
SCALED_GTOL = dict(rtol=1e-5, atol=5e-5)


def branch_of(W):
    def branch(x):
        return jnp.tanh(x @ W)

    return branch


def layer(p, x):
    return x + jnp.tanh(x @ p["w"] + p["b"])


# ----------------------------------------------------------------------------- drop_path


@pytest.mark.parametrize("mode", ["row", "batch"])
def test_drop_path_is_the_documented_formula(mode):
    rate = 0.3
    shape = (B, 1) if mode == "row" else (1, 1)
    keep = jax.random.bernoulli(KEY, 1 - rate, shape)
    tree_allclose(dnn.drop_path(X, KEY, rate, mode=mode), jnp.where(keep, X / (1 - rate), 0.0))
    tree_allclose(dnn.drop_path(X, KEY, rate, mode=mode, scale=False), jnp.where(keep, X, 0.0))


@pytest.mark.parametrize("mode", ["row", "batch"])
def test_drop_path_keeps_the_mean_and_drops_the_rate(mode):
    rate, n_keys = 0.25, 4000
    x = jnp.ones((4, 2)) * jnp.array([1.0, -2.0])
    keys = jax.random.split(jax.random.PRNGKey(6), n_keys)
    out = np.asarray(jax.jit(jax.vmap(lambda k: dnn.drop_path(x, k, rate, mode=mode)))(keys))
    samples = out.reshape(n_keys, -1)
    mean, se = samples.mean(0), samples.std(0, ddof=1) / np.sqrt(n_keys)
    assert np.all(np.abs(mean - np.asarray(x).reshape(-1)) < 3 * se + 1e-6), (mean, se)
    dropped = (out[:, :, 0] == 0).mean()  # fraction of dropped rows
    n_dec = n_keys * (4 if mode == "row" else 1)
    assert abs(dropped - rate) < 3 * np.sqrt(rate * (1 - rate) / n_dec)
    if mode == "batch":  # one decision for the whole tensor
        assert np.all((out == 0).all(axis=(1, 2)) | (out != 0).all(axis=(1, 2)))


def test_drop_path_identity_cases_and_traced_rate():
    tree_allclose(dnn.drop_path(X, KEY, 0.5, deterministic=True), X)
    tree_allclose(dnn.drop_path(X, None, 0.0), X)
    tree_allclose(dnn.drop_path(X, None, 0.5, deterministic=True), X)
    traced = jax.jit(lambda r: dnn.drop_path(X, KEY, r))(jnp.float32(0.3))
    tree_allclose(traced, dnn.drop_path(X, KEY, 0.3))
    bf = X.astype(jnp.bfloat16)
    assert dnn.drop_path(bf, KEY, jnp.float32(0.3)).dtype == jnp.bfloat16


def test_drop_path_gradient_is_the_scaled_mask():
    rate = 0.4
    g = jax.grad(lambda x: jnp.sum(dnn.drop_path(x, KEY, rate)))(X)
    keep = jax.random.bernoulli(KEY, 1 - rate, (B, 1))
    tree_allclose(g, jnp.broadcast_to(jnp.where(keep, 1 / (1 - rate), 0.0), X.shape))


@pytest.mark.parametrize("rate", [-0.1, 1.5, float("nan")])
def test_drop_path_rejects_rates_outside_unit_interval(rate):
    with pytest.raises(ValueError, match=r"`rate` must lie in \[0, 1\], got"):
        dnn.drop_path(X, KEY, rate)
    with pytest.raises(ValueError, match=r"`rate` must lie in \[0, 1\]"):
        dnn.drop_path(X, KEY, jnp.float32(rate))


@pytest.mark.parametrize("mode", ["row", "batch"])
def test_rate_one_drops_everything_with_zero_gradients(mode):
    """As timm and torchvision: rate 1 drops everything; a traced rate of 1 too, and its
    gradients are zeros, not NaN."""
    tree_allclose(dnn.drop_path(X, KEY, 1.0, mode=mode), jnp.zeros_like(X))
    g = jax.grad(lambda x, r: jnp.sum(dnn.drop_path(x, KEY, r, mode=mode)), argnums=(0, 1))
    gx, gr = jax.jit(g)(X, jnp.float32(1.0))
    tree_allclose(gx, jnp.zeros_like(X))
    assert np.isfinite(float(gr))
    out = dnn.stochastic_residual(branch_of(W), X, KEY, 1.0, mode=mode)
    tree_allclose(out, X)
    tree_allclose(dnn.layer_drop(layer, PARAMS, X, KEY, 1.0, mode=mode, scale=True), X)


def test_drop_path_argument_errors():
    with pytest.raises(ValueError, match=r"`mode` must be one of \('row', 'batch'\), got 'col'"):
        dnn.drop_path(X, KEY, 0.1, mode="col")
    with pytest.raises(TypeError, match=r"`key` is None"):
        dnn.drop_path(X, None, 0.1)
    with pytest.raises(TypeError, match=r"`key` must be a PRNG key"):
        dnn.drop_path(X, 3, 0.1)
    with pytest.raises(ValueError, match=r'mode="row" needs an array with a leading batch axis'):
        dnn.drop_path(jnp.float32(1.0), KEY, 0.1)
    with pytest.raises(TypeError, match=r"`deterministic` must be a static Python bool"):
        dnn.drop_path(X, KEY, 0.1, deterministic=jnp.array(True))
    with pytest.raises(ValueError, match=r"`rate` must have shape \(\)"):
        dnn.drop_path(X, KEY, jnp.zeros((2,)))


# ----------------------------------------------------------------------------- stochastic_residual


def residual_reference(W, x, key, rate, mode, scale=True):
    return x + dnn.drop_path(branch_of(W)(x), key, rate, mode=mode, scale=scale)


@pytest.mark.parametrize(
    "mode,capacity", [("batch", None), ("row", None), ("row", 2), ("row", B)], ids=str
)
def test_stochastic_residual_matches_drop_path_in_value_and_gradient(mode, capacity):
    rate = 0.5

    def fast(W, x, key):
        return dnn.stochastic_residual(branch_of(W), x, key, rate, mode=mode, capacity=capacity)

    def loss(fn):
        return lambda W, x, key: jnp.sum(jnp.sin(fn(W, x, key)))

    ref = lambda W, x, key: residual_reference(W, x, key, rate, mode)  # noqa: E731
    fast_vg = jax.jit(jax.value_and_grad(loss(fast), argnums=(0, 1)))
    ref_vg = jax.value_and_grad(loss(ref), argnums=(0, 1))
    for key in KEYS[:4]:
        tree_allclose(jax.jit(fast)(W, X, key), ref(W, X, key))
        tree_allclose(fast_vg(W, X, key), ref_vg(W, X, key), **GTOL)


def test_stochastic_residual_batch_mode_skips_the_branch():
    counter = Counter()

    def branch(x):
        counter.tick()
        return jnp.tanh(x @ W)

    f = jax.jit(lambda key: dnn.stochastic_residual(branch, X, key, 0.5))
    kept = [bool(jax.random.bernoulli(k, 0.5, (1, 1))[0, 0]) for k in KEYS]
    assert 0 < sum(kept) < len(kept)
    for k, keep in zip(KEYS, kept, strict=True):
        assert counter.run(f, k) == int(keep)
    assert counter.run(jax.jit(lambda: dnn.stochastic_residual(branch, X, None, 0.0))) == 1


def test_stochastic_residual_row_mode_runs_the_branch_on_the_gathered_rows():
    seen = []

    def branch(x):
        seen.append(x.shape[0])
        return jnp.tanh(x @ W)

    x = jnp.tile(X, (8, 1))  # 48 rows; rate 0.5 -> capacity ceil(24 + 3 sqrt(12)) = 35
    out = dnn.stochastic_residual(branch, x, KEY, 0.5, mode="row")
    assert 35 in seen and x.shape[0] in seen  # gathered path, and the overflow fallback
    tree_allclose(out, residual_reference(W, x, KEY, 0.5, "row"))
    seen.clear()
    dnn.stochastic_residual(branch, x, KEY, 0.5, mode="row", capacity=x.shape[0])
    assert seen == [x.shape[0]] * len(seen)


def test_stochastic_residual_under_vmap_and_deterministic():
    f = jax.vmap(lambda x, k: dnn.stochastic_residual(branch_of(W), x, k, 0.5))
    ref = jnp.stack([residual_reference(W, X[b], KEYS[b], 0.5, "batch") for b in range(B)])
    tree_allclose(jax.jit(f)(X, KEYS[:B]), ref)
    det = dnn.stochastic_residual(branch_of(W), X, KEY, 0.5, deterministic=True)
    tree_allclose(det, X + branch_of(W)(X))


def test_stochastic_residual_errors():
    with pytest.raises(TypeError, match=r"`branch` must be callable"):
        dnn.stochastic_residual(None, X, KEY, 0.1)
    with pytest.raises(TypeError, match=r"`branch` must keep the shape and dtype of x"):
        dnn.stochastic_residual(lambda x: x[:, :2], X, KEY, 0.1)
    with pytest.raises(ValueError, match=r"`capacity` must lie in \[1, B\] = \[1, 6\]"):
        dnn.stochastic_residual(branch_of(W), X, KEY, 0.1, mode="row", capacity=7)
    with pytest.raises(ValueError, match=r"`rate` must lie in \[0, 1\], got 1.5"):
        dnn.stochastic_residual(branch_of(W), X, KEY, 1.5)
    with pytest.raises(ValueError, match=r"`mode` must be one of"):
        dnn.stochastic_residual(branch_of(W), X, KEY, 0.1, mode="rows")


# ----------------------------------------------------------------------------- layer_drop


def layer_drop_reference(params, x, key, rate, mode, scale=False):
    """The docstring's loop: every layer computed, kept rows selected (the masked method)."""
    rates = jnp.broadcast_to(jnp.asarray(rate, jnp.float32), (L,))
    if mode == "batch":
        keep = jax.random.bernoulli(key, 1 - rates)[:, None]
    else:
        keep = jax.random.bernoulli(key, 1 - rates[:, None], (L, x.shape[0]))
    for i in range(L):
        y = layer(jax.tree_util.tree_map(lambda a, i=i: a[i], params), x)
        if scale:
            y = x + (y - x) / (1 - rates[i])
        x = jnp.where(keep[i][:, None], y, x)
    return x


LD_CASES = [
    ("batch", 0.5, False, "auto"),
    ("batch", "schedule", True, "auto"),
    ("row", 0.4, False, "auto"),
    ("batch", 0.5, False, "masked"),
]


@pytest.mark.parametrize("mode,rate,scale,strategy", LD_CASES, ids=str)
def test_layer_drop_matches_masked_reference_in_value_and_gradient(mode, rate, scale, strategy):
    if rate == "schedule":
        rate = dnn.survival_schedule(L, 0.6)

    def fast(params, x, key):
        return dnn.layer_drop(
            layer, params, x, key, rate, mode=mode, scale=scale, strategy=strategy
        )

    def ref(params, x, key):
        return layer_drop_reference(params, x, key, rate, mode, scale)

    def loss(fn):
        return lambda p, x, key: jnp.sum(jnp.sin(fn(p, x, key)))

    fast_vg = jax.jit(jax.value_and_grad(loss(fast), argnums=(0, 1)))
    ref_vg = jax.value_and_grad(loss(ref), argnums=(0, 1))
    for key in KEYS[:3]:
        tree_allclose(jax.jit(fast)(PARAMS, X, key), ref(PARAMS, X, key))
        (v, (gp, gx)), (rv, (rgp, rgx)) = fast_vg(PARAMS, X, key), ref_vg(PARAMS, X, key)
        # Scaled by 1 / (1 - rate), the weights' gradients reach about 8: float32 rounding
        # through five layers then moves an entry by about 1e-5 between compiled programs.
        tree_allclose((v, gp, gx), (rv, rgp, rgx), **(SCALED_GTOL if scale else GTOL))
        if mode == "batch":  # dropped layers get exactly zero gradient
            rates = jnp.broadcast_to(jnp.asarray(rate, jnp.float32), (L,))
            dropped = ~np.asarray(jax.random.bernoulli(key, 1 - rates))
            assert np.all(np.asarray(gp["w"])[dropped] == 0)


def test_layer_drop_cost_follows_the_kept_layers():
    counter = Counter()

    def counted(p, x):
        counter.tick()
        return layer(p, x)

    f = jax.jit(lambda key: dnn.layer_drop(counted, PARAMS, X, key, 0.5))
    # With a gradient too: the forward pass stores each kept layer's residuals (its parameters
    # referenced in the stack, not copied) and the backward pass does not recompute the layer.
    vg = jax.jit(
        jax.value_and_grad(lambda p, key: jnp.sum(dnn.layer_drop(counted, p, X, key, 0.5) ** 2))
    )
    for key in KEYS[:4]:
        kept = int(jnp.sum(jax.random.bernoulli(key, 0.5, (L,))))
        assert counter.run(f, key) == kept
        assert counter.run(vg, PARAMS, key) == kept


def test_layer_drop_references_the_layer_parameters_instead_of_storing_them():
    """One row of width 8: a layer's 8x8 weight is 8x the carry, over the 4x stored-residual
    budget, so a single evaluation per kept layer under value_and_grad shows that the backward
    pass takes the weight from the stack instead of a per-layer copy; gradients stay right."""
    counter = Counter()
    k1, k2 = jax.random.split(jax.random.PRNGKey(7))
    params = {"w": jax.random.normal(k1, (L, 8, 8)) / 3, "b": jnp.zeros((L, 8))}
    x = jax.random.normal(k2, (1, 8))

    def counted(p, x):
        counter.tick()
        return layer(p, x)

    def loss(p, key):
        return jnp.sum(jnp.sin(dnn.layer_drop(counted, p, x, key, 0.5)))

    def ref_loss(p, key):
        return jnp.sum(jnp.sin(layer_drop_reference(p, x, key, 0.5, "batch")))

    vg = jax.jit(jax.value_and_grad(loss))
    for key in KEYS[:3]:
        kept = int(jnp.sum(jax.random.bernoulli(key, 0.5, (L,))))
        assert counter.run(vg, params, key) == kept
        tree_allclose(vg(params, key), jax.value_and_grad(ref_loss)(params, key), **GTOL)


def test_layer_drop_per_sample_keys_under_vmap():
    def loss(p):
        out = jax.vmap(lambda x, k: dnn.layer_drop(layer, p, x, k, 0.5))(X, KEYS[:B])
        return jnp.sum(out**2), out

    def ref_loss(p):
        out = jnp.stack(
            [layer_drop_reference(p, X[b][None], KEYS[b], 0.5, "batch")[0] for b in range(B)]
        )
        return jnp.sum(out**2), out

    got = jax.jit(jax.value_and_grad(loss, has_aux=True))(PARAMS)
    tree_allclose(got, jax.value_and_grad(ref_loss, has_aux=True)(PARAMS), **GTOL)


def test_layer_drop_deterministic_runs_every_layer():
    ref = layer_drop_reference(PARAMS, X, KEY, 0.0, "batch")
    tree_allclose(dnn.layer_drop(layer, PARAMS, X, KEY, 0.5, deterministic=True), ref)
    tree_allclose(dnn.layer_drop(layer, PARAMS, X, None, 0.0), ref)


def test_layer_drop_errors():
    with pytest.raises(ValueError, match=r"`rate` must lie in \[0, 1\], got 1.5"):
        dnn.layer_drop(layer, PARAMS, X, KEY, 1.5)
    with pytest.raises(ValueError, match=r"`rate` must lie in \[0, 1\], got -0.5 at index 2"):
        dnn.layer_drop(layer, PARAMS, X, KEY, jnp.array([0.1, 0.2, -0.5, 0.1, 0.1]))
    with pytest.raises(ValueError, match=r"`rate` must have shape \(\) or \(5,\), got shape"):
        dnn.layer_drop(layer, PARAMS, X, KEY, jnp.zeros((4,)))
    with pytest.raises(ValueError, match=r"`mode` must be one of \('row', 'batch'\), got 'x'"):
        dnn.layer_drop(layer, PARAMS, X, KEY, 0.1, mode="x")
    with pytest.raises(ValueError, match=r"different leading axes: 5 at stacked_params\['b'\]"):
        dnn.layer_drop(layer, {"b": PARAMS["b"], "w": PARAMS["w"][:4]}, X, KEY, 0.1)
    with pytest.raises(TypeError, match=r"`layer_fn` must keep the shape and dtype of x"):
        dnn.layer_drop(lambda p, x: x.astype(jnp.int32), PARAMS, X, KEY, 0.1)
    with pytest.raises(TypeError, match=r"`key` is None"):
        dnn.layer_drop(layer, PARAMS, X, None, 0.1)
    with pytest.raises(ValueError, match=r"`strategy` must be one of"):
        dnn.layer_drop(layer, PARAMS, X, KEY, 0.1, strategy="fast")


def test_layer_drop_shared_key_under_vmap_skips_dropped_layers():
    """A key shared by the vmapped samples: one decision per layer, dropped layers skipped."""
    counter = Counter()

    def counted(p, x):
        counter.tick()
        return layer(p, x)

    f = jax.jit(lambda key: jax.vmap(lambda x: dnn.layer_drop(counted, PARAMS, x, key, 0.5))(X))
    for key in KEYS[:3]:
        kept = int(jnp.sum(jax.random.bernoulli(key, 0.5, (L,))))
        assert counter.run(f, key) == kept
        ref = layer_drop_reference(PARAMS, X, key, 0.5, "batch")
        tree_allclose(f(key), ref)
