"""A loop under two ``vmap`` levels chooses one slot count for every element of the outer one
(``dyndepth._slots.outer_level``): the choice is not batched, so the conditionals over the
counts (a CPU's and a GPU's) and over each count's set-up (a TPU's chain) stay conditionals
instead of selects that run every branch. The groups here prefer different counts alone (one
shallow but for one deep sample, one deep throughout); values and gradients equal the
plain-Python loop's, with every carry stored and with two stored per sample (a thinned store,
which a wrap-around pass writes in schedule order where it fits; the backward pass runs the
forward pass's count there), under the time rule and the work rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import reference_repeat, tree_allclose

import dyndepth as dd

D, MAX = 3, 8
DEPTHS = jnp.array([[8, 0, 1, 0, 0, 1, 0, 0], [8, 7, 8, 6, 8, 7, 8, 5]], jnp.int32)
G, B = DEPTHS.shape
X = jax.random.normal(jax.random.PRNGKey(0), (G, B, D))
W = jax.random.normal(jax.random.PRNGKey(1), (D, D)) * 0.5


def step(W):
    return lambda c: jnp.tanh(c @ W) + 0.5 * c


def loss(W, checkpoints, slots):
    def one(x, d):
        return dd.repeat(step(W), x, d, max_depth=MAX, checkpoints=checkpoints, slots=slots)

    return jnp.sum(jnp.sin(jax.vmap(jax.vmap(one))(X, DEPTHS)))


def reference_loss(W):
    return sum(jnp.sum(jnp.sin(reference_repeat(step(W), X[g, b], int(DEPTHS[g, b]))))
               for g in range(G) for b in range(B))  # fmt: skip


@pytest.mark.parametrize("slots", [None, "work"])
@pytest.mark.parametrize("checkpoints", [None, 2])
@pytest.mark.parametrize("platform", ["cpu", "tpu", "cuda"])
def test_one_count_for_every_outer_element(trace_kernels_for, platform, checkpoints, slots):
    """The kernels traced for this CPU, for a TPU (its chain of the counts' loops) and for a GPU
    (the CPU's conditional over the counts, its stores written with fewer conditionals)."""
    trace_kernels_for(platform)
    want = jax.value_and_grad(reference_loss)(W)
    vg = jax.jit(jax.value_and_grad(lambda W: loss(W, checkpoints, slots)))
    tree_allclose(vg(W), want, rtol=2e-5, atol=2e-5)
    # Several counts in the ladder, each pass's choice one for both groups: a conditional over
    # the counts, or a chain's conditional per count's set-up (JAX turns a
    # conditional whose index is batched into a select before lowering).
    assert "stablehlo.case" in vg.lower(W).as_text()


def test_the_groups_alone_choose_different_counts():
    """The premise of the test above: alone, the shallow group and the deep one choose
    different slot counts."""

    def count(depths):
        _, stats = dd.repeat_batched(step(W), X[0], depths, max_depth=MAX, return_stats=True)
        return int(stats["executed_sample_steps"]) // int(stats["iterations"])

    assert count(DEPTHS[0]) != count(DEPTHS[1])
