"""Tests for ``dyndepth.nn.sample_depth``, ``sample_nk`` and ``survival_schedule``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tree_allclose

import dyndepth.nn as dnn

KEY = jax.random.PRNGKey(0)
N = 20000  # draws for the distribution checks


def within(sample, expected_mean, k=4.0):
    sample = np.asarray(sample, np.float64)
    se = sample.std(ddof=1) / np.sqrt(sample.size)
    assert abs(sample.mean() - expected_mean) < k * se, (sample.mean(), expected_mean, se)


# ----------------------------------------------------------------------------- sample_depth


def test_uniform_depths_are_the_documented_draw_and_cover_the_range():
    d = dnn.sample_depth(KEY, (N,), dist="uniform", low=2, high=6)
    assert d.dtype == jnp.int32 and d.shape == (N,)
    tree_allclose(d, jax.random.randint(KEY, (N,), 2, 7, dtype=jnp.int32))
    assert set(np.unique(np.asarray(d))) == {2, 3, 4, 5, 6}
    within(d, 4.0)
    assert dnn.sample_depth(KEY, dist="uniform", low=3, high=3).shape == ()
    assert int(dnn.sample_depth(KEY, 4, dist="uniform", low=5, high=9, max_depth=5).max()) == 5


def test_poisson_lognormal_depths():
    mean, sigma = 8.0, 0.5
    d = dnn.sample_depth(KEY, (N,), dist="poisson_lognormal", mean=mean, sigma=sigma)
    assert d.dtype == jnp.int32 and int(d.min()) >= 1
    within(d, 1.0 + mean)  # E[1 + Poisson(tau)] = 1 + E[tau] = 1 + mean
    k1, k2 = jax.random.split(KEY)
    tau = jnp.exp(np.log(mean) - sigma**2 / 2 + sigma * jax.random.normal(k1, (N,)))
    tree_allclose(d, 1 + jax.random.poisson(k2, tau, (N,), dtype=jnp.int32))
    clipped = dnn.sample_depth(KEY, (N,), dist="poisson_lognormal", mean=mean, max_depth=6)
    tree_allclose(clipped, jnp.minimum(d, 6))


def test_sample_depth_under_jit_and_vmap():
    keys = jax.random.split(KEY, 3)
    kw = dict(dist="uniform", low=1, high=9)
    f = jax.jit(jax.vmap(lambda k: dnn.sample_depth(k, (2,), **kw)))
    tree_allclose(f(keys), jnp.stack([dnn.sample_depth(k, (2,), **kw) for k in keys]))


def test_sample_depth_errors():
    with pytest.raises(ValueError, match=r"`dist` must be one of .*got 'normal'"):
        dnn.sample_depth(KEY, dist="normal")
    with pytest.raises(ValueError, match=r'dist="uniform" needs both `low` and `high`'):
        dnn.sample_depth(KEY, dist="uniform", low=1)
    with pytest.raises(ValueError, match=r"`high` must be >= `low`, got low=4, high=2"):
        dnn.sample_depth(KEY, dist="uniform", low=4, high=2)
    with pytest.raises(ValueError, match=r"`low` must be >= 0, got -1"):
        dnn.sample_depth(KEY, dist="uniform", low=-1, high=2)
    with pytest.raises(ValueError, match=r"needs `mean`"):
        dnn.sample_depth(KEY, dist="poisson_lognormal")
    with pytest.raises(ValueError, match=r"`mean` must be > 0, got 0.0"):
        dnn.sample_depth(KEY, dist="poisson_lognormal", mean=0.0)
    with pytest.raises(ValueError, match=r"`sigma` must be >= 0, got -0.5"):
        dnn.sample_depth(KEY, dist="poisson_lognormal", mean=2.0, sigma=-0.5)
    with pytest.raises(TypeError, match=r"`key` must be a PRNG key"):
        dnn.sample_depth(jnp.zeros((3,)), dist="uniform", low=0, high=1)
    with pytest.raises(TypeError, match=r"`shape\[1\]` must be a static Python int"):
        dnn.sample_depth(KEY, (2, 1.5), dist="uniform", low=0, high=1)


# ----------------------------------------------------------------------------- sample_nk


@pytest.mark.parametrize("kind", ["deep_thinking", "uniform_pairs"])
def test_pairs_are_valid(kind):
    M = 7
    n, k = dnn.sample_nk(KEY, (N,), max_iters=M, kind=kind)
    n, k = np.asarray(n), np.asarray(k)
    assert n.dtype == np.int32 and k.dtype == np.int32
    assert n.min() >= 0 and k.min() >= 1 and (n + k).max() <= M
    pairs = {(int(a), int(b)) for a, b in zip(n, k, strict=True)}
    assert pairs == {(a, b) for a in range(M) for b in range(1, M - a + 1)}


def test_deep_thinking_pairs_follow_bansal_et_al_and_are_skewed():
    M = 7
    n, k = dnn.sample_nk(KEY, (N,), max_iters=M)
    k1, k2 = jax.random.split(KEY)
    n_ref = jax.random.randint(k1, (N,), 0, M, dtype=jnp.int32)
    k_ref = jax.random.randint(k2, (N,), 1, M - n_ref + 1, dtype=jnp.int32)
    tree_allclose((n, k), (n_ref, k_ref))
    within(k, (M + 3) / 4)  # the documented skew towards small k
    harmonic = np.cumsum(1.0 / np.arange(1, M + 1))
    p_k1 = harmonic[-1] / M
    assert abs(np.mean(np.asarray(k) == 1) - p_k1) < 4 * np.sqrt(p_k1 * (1 - p_k1) / N)


def test_uniform_pairs_are_uniform():
    M = 6
    n, k = dnn.sample_nk(KEY, (N,), max_iters=M, kind="uniform_pairs")
    within(k, (M + 2) / 3)
    within(n, (M - 1) / 3)
    counts = np.zeros((M, M + 1))
    np.add.at(counts, (np.asarray(n), np.asarray(k)), 1)
    valid = counts[counts > 0]
    assert valid.size == M * (M + 1) // 2
    expected = N / valid.size
    assert np.all(np.abs(valid - expected) < 5 * np.sqrt(expected))


def test_sample_nk_single_pair_under_jit_and_errors():
    n, k = jax.jit(lambda key: dnn.sample_nk(key, max_iters=1))(KEY)
    assert (int(n), int(k)) == (0, 1)
    with pytest.raises(ValueError, match=r"`max_iters` must be >= 1, got 0"):
        dnn.sample_nk(KEY, max_iters=0)
    with pytest.raises(TypeError, match=r"`max_iters` must be a static Python int"):
        dnn.sample_nk(KEY, max_iters=jnp.int32(3))
    with pytest.raises(ValueError, match=r"`kind` must be one of .*got 'huginn'"):
        dnn.sample_nk(KEY, max_iters=3, kind="huginn")


# ----------------------------------------------------------------------------- survival_schedule


def test_survival_schedule():
    rates = dnn.survival_schedule(4, 0.5)
    tree_allclose(rates, jnp.array([0.125, 0.25, 0.375, 0.5], jnp.float32))
    tree_allclose(dnn.survival_schedule(3, 0.2, kind="uniform"), jnp.full((3,), 0.2))
    assert dnn.survival_schedule(0, 0.5).shape == (0,)
    with pytest.raises(ValueError, match=r"`final_rate` must lie in \[0, 1\], got 1.5"):
        dnn.survival_schedule(4, 1.5)
    with pytest.raises(ValueError, match=r"`kind` must be one of \('linear', 'uniform'\)"):
        dnn.survival_schedule(4, 0.1, kind="exp")
    with pytest.raises(ValueError, match=r"`num_layers` must be >= 0, got -1"):
        dnn.survival_schedule(-1, 0.1)
