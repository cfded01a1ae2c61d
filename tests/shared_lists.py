"""The lists that several test files run over, in one place: the loops' strategies, their
``(strategy, checkpoints)`` configurations and the ids pytest shows for them, the key
implementations that ``vmap`` batches with one key, and the depth distributions the per-sample
scheduler is held to.

A strategy or configuration added here reaches every test that runs over the list. A test that
means a particular subset (the strategies that accept a given argument, say) writes it out.
"""

from __future__ import annotations

import itertools
import os

import jax
import jax.numpy as jnp

# ----------------------------------------------------------------------------- cross-products

# ``make test-full`` (tests/conftest.py reads the same variable before JAX starts).
FULL = os.environ.get("DYNDEPTH_FULL") == "1"


def covering(*axes: list, crossed: int = 2) -> list[tuple]:
    """Tuples of one value per axis: with ``DYNDEPTH_FULL=1`` (``make test-full``) every
    combination; otherwise the first ``crossed`` axes in every combination and each later axis
    turning with the combination's position (the sum of its indices), so that every value of
    a later axis meets every value of each crossed axis at least as long as it. ``make test``
    then compiles a fraction of a cross-product and still meets every pair that matters."""
    if FULL:
        return list(itertools.product(*axes))
    out = []
    for index in itertools.product(*(range(len(a)) for a in axes[:crossed])):
        turn = sum(index)
        values = [a[i] for a, i in zip(axes, index, strict=False)]
        out.append(tuple(values + [a[turn % len(a)] for a in axes[crossed:]]))
    return out


# ----------------------------------------------------------------------------- strategies

# Every strategy of ``repeat``, ``scan`` and ``while_loop``.
STRATEGIES = ["masked", "while", "checkpointed", "auto"]
# The strategies with reverse mode ("while" raises under every reverse-mode transformation).
GRAD_STRATEGIES = ["masked", "checkpointed", "auto"]
# The strategies with a backward pass of their own, which take ``checkpoints``.
CHECKPOINTING_STRATEGIES = ["checkpointed", "auto"]

# ``(strategy, checkpoints)`` for the reverse-mode tests: every one, a shorter and a middle list
# for the tests that compile more per case.
GRAD_CONFIGS = [
    ("masked", None),
    ("checkpointed", None),
    ("checkpointed", 1),
    ("checkpointed", 2),
    ("checkpointed", 3),
    ("auto", None),
    ("auto", 2),
]
SHORT_GRAD_CONFIGS = [("masked", None), ("checkpointed", None), ("checkpointed", 2), ("auto", None)]
MID_GRAD_CONFIGS = [
    ("masked", None),
    ("checkpointed", None),
    ("checkpointed", 1),
    ("checkpointed", 3),
    ("auto", 2),
]


def cfg_id(cfg) -> str:
    """The test id of a ``(strategy, checkpoints, ...)`` configuration: ``"auto"``,
    ``"checkpointed-K2"``, ``"auto-K2-within"`` (further entries joined on)."""
    strategy, k = cfg[:2]
    return "-".join([strategy] + ([] if k is None else [f"K{k}"]) + [str(e) for e in cfg[2:]])


# ----------------------------------------------------------------------------- keys

# The key implementations JAX batches with the batch's first key for every sample under ``vmap``.
RBG_IMPLS = ["rbg", "unsafe_rbg"]

# ----------------------------------------------------------------------------- depth distributions


def uniform_depths(key, B, hi):
    """``B`` depths uniform in ``[1, hi]``."""
    return jax.random.randint(key, (B,), 1, hi + 1)


def long_tail_depths(key, B, hi):
    """``B`` depths ``1 + Poisson(LogNormal)`` (mean about 33), clipped to ``[1, hi]``."""
    k1, k2 = jax.random.split(key)
    tau = jnp.exp(jnp.log(32.0) - 0.125 + 0.5 * jax.random.normal(k1, (B,)))
    return jnp.clip(1 + jax.random.poisson(k2, tau), 1, hi).astype(jnp.int32)


# The depth distributions the scheduler's work rule is held to (docs/performance.md;
# benchmarks/scheduler.py times distributions of the same names, with parameters of its own).
DISTRIBUTIONS = (
    "bimodal",
    "one-deep-many-shallow",
    "few-deep",
    "geometric",
    "uniform",
    "long-tail",
    "all-equal",
    "all-zero",
)


def depths_of(name, key, B, hi):
    """``B`` depths in ``[0, hi]`` drawn from the distribution ``name`` of ``DISTRIBUTIONS``."""
    if name == "bimodal":  # about half at the top, half at 1
        return jnp.where(jax.random.bernoulli(key, 0.53, (B,)), hi, 1)
    if name == "one-deep-many-shallow":
        return jnp.zeros((B,), jnp.int32).at[0].set(hi)
    if name == "few-deep":
        return jnp.where(jnp.arange(B) % 32 == 0, hi, jax.random.randint(key, (B,), 0, 3))
    if name == "geometric":
        return jnp.minimum(jax.random.geometric(key, 0.2, (B,)), hi).astype(jnp.int32)
    if name == "uniform":
        return uniform_depths(key, B, hi)
    if name == "long-tail":
        return long_tail_depths(key, B, hi)
    if name == "all-equal":
        return jnp.full((B,), hi // 3, jnp.int32)
    assert name == "all-zero"
    return jnp.zeros((B,), jnp.int32)
