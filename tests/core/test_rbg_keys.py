"""The key schedule for every key implementation (issue 29, item 5).

JAX batches the ``rbg`` and ``unsafe_rbg`` generators with the batch's first key for every
sample, so under ``vmap`` a step's draws would depend on the sample's neighbours. dyndepth keeps
the schedule (step ``i`` of a sample draws from ``fold_in(key, i)``, whatever the batch) by
running such a batch one sample after another (strategies ``"auto"``, ``"checkpointed"`` and
``"while"``), and refuses it at trace time for ``"masked"``, a plain ``lax`` loop that ``vmap``
batches as a whole.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import test_transform_matrix as tm
from helpers import reference_repeat, tree_allclose
from shared_lists import RBG_IMPLS, cfg_id

import dyndepth as dd


def keys_of(impl, n, seed=3):
    return jax.random.split(jax.random.key(seed, impl=impl), n)


def step(c, k):
    return c + jax.random.normal(k, c.shape)


@pytest.mark.parametrize("impl", RBG_IMPLS)
@pytest.mark.parametrize("strategy", ["auto", "checkpointed", "while"])
def test_batched_draws_are_each_samples_own(impl, strategy):
    x = jnp.ones((4, 3))
    depths = jnp.array([3, 1, 4, 0], jnp.int32)
    keys = keys_of(impl, 4)

    def run(x, d, k):
        return dd.repeat(step, x, d, max_depth=4, key=k, strategy=strategy)

    batched = jax.jit(jax.vmap(run))(x, depths, keys)
    alone = jnp.stack([reference_repeat(step, x[b], int(depths[b]), key=keys[b]) for b in range(4)])
    tree_allclose(batched, alone)
    # another first sample leaves the others' draws alone
    other = jax.jit(jax.vmap(run))(x, depths, keys.at[0].set(jax.random.key(99, impl=impl)))
    tree_allclose(other[1:], batched[1:])
    # a shared key with per-sample inputs: every sample draws what it draws alone
    shared = jax.jit(jax.vmap(run, (0, None, None)))(x * jnp.arange(4.0)[:, None], 2, keys[1])
    want = [reference_repeat(step, x[b] * b, 2, key=keys[1]) for b in range(4)]
    tree_allclose(shared, jnp.stack(want))


@pytest.mark.parametrize("impl", RBG_IMPLS)
def test_masked_refuses_per_sample_rbg_keys_at_trace_time(impl):
    def run(x, k):
        return dd.repeat(step, x, 2, max_depth=3, key=k, strategy="masked")

    msg = rf"implementation {impl!r} batched under jax.vmap .* strategy='masked'"
    with pytest.raises(ValueError, match=msg):
        jax.jit(jax.vmap(run)).trace(jnp.ones((2, 3)), keys_of(impl, 2))
    # one key shared by the batch draws alike for every sample: allowed
    out = jax.jit(jax.vmap(run, (0, None)))(jnp.ones((2, 3)), keys_of(impl, 1)[0])
    tree_allclose(out[0], out[1])


def test_stats_of_a_batch_run_one_sample_at_a_time():
    keys = keys_of("rbg", 3)
    depths = jnp.array([2, 0, 3], jnp.int32)
    out, stats = dd.repeat_batched(step, jnp.ones((3, 2)), depths, max_depth=4, keys=keys,
                                   return_stats=True)  # fmt: skip
    want = [
        reference_repeat(step, jnp.ones(2), int(d), key=k)
        for d, k in zip(depths, keys, strict=True)
    ]
    tree_allclose(out, jnp.stack(want))
    assert int(stats["useful_sample_steps"]) == 5


# The transform matrix with rbg keys: each transform once, the case and configuration rotating,
# against the same plain-Python references (which draw each sample's numbers alone). Not
# layer_drop: its keep mask is drawn outside any loop, by JAX, whose vmap of an rbg draw mixes
# the samples (docs/limits.md).
CONFIGS = [c for c in tm.CONFIGS if c[0] != "masked"]
REVERSE_CONFIGS = [c for c in CONFIGS if c[0] != "while"]
CASES = [c for c in tm.CASES if c != "layer_drop"]
COMBOS = [(name, CASES[j % len(CASES)], REVERSE_CONFIGS[j % len(REVERSE_CONFIGS)])
          for j, name in enumerate(tm.REVERSE)]  # fmt: skip
COMBOS += [(name, CASES[(j + 2) % len(CASES)], CONFIGS[(j + 1) % len(CONFIGS)])
           for j, name in enumerate(tm.FORWARD)]  # fmt: skip


def rbg_args(case, depths):
    keys = keys_of("rbg", tm.G * tm.B)
    if case == "scan":
        return (tm.X, depths, keys, tm.SEQ)
    return (tm.X, depths, keys)


@pytest.mark.parametrize(("name", "case", "cfg"), COMBOS,
                         ids=[f"{n}-{c}-{cfg_id(k)}" for n, c, k in COMBOS])  # fmt: skip
def test_transform_matrix_with_rbg_keys(name, case, cfg):
    transform = {**tm.REVERSE, **tm.FORWARD}[name]
    fn, _ = tm.CASES[case](*cfg[:2])
    _, ref = tm.CASES[case]("masked", None)
    args = rbg_args(case, tm.depths_of(cfg))
    got = jax.jit(lambda p, *a: transform(jax.vmap, fn, p, a))(tm.PARAMS, *args)
    want = transform(tm.python_vmap, ref, tm.PARAMS, args)
    tree_allclose(got, want, **tm.TOL, err_msg=f"{case} {cfg_id(cfg)} {name}")
