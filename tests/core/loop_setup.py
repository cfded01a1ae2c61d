"""The problem the tests of ``repeat`` and ``scan`` share (test_repeat.py,
test_repeat_autodiff.py, test_repeat_cost.py, test_scan.py): sizes, weights, inputs, per-sample
depths and keys, the two residual layers (keyless ``"tanh"``, keyed ``"dropout"``), ``run`` (the
layer in ``dd.repeat``) and ``ref`` (its plain-Python reference), and a cache for comparison
targets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from helpers import reference_repeat

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
