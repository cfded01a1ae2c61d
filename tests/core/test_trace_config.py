"""A step traced under one configuration is not reused under another (issue 40, hostile pass 3).

The traced step is cached on the function object, so that an un-jitted loop called again does
not trace and compile again. The cache is keyed on every option JAX keys its own traces on
(``dyndepth._compat.trace_context``): after a first call, the same step under
``jax.default_matmul_precision("highest")`` traces its matmuls at that precision, and under
``jax.numpy_rank_promotion("raise")`` an implicit rank promotion raises, as ``lax.scan``'s do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from shared_lists import STRATEGIES

import dyndepth as dd
from dyndepth import _compat

W = jnp.linspace(-1.0, 1.0, 9).reshape(3, 3)
B = jnp.array([0.1, 0.2, 0.3])
X = jnp.ones((2, 3))


def matmul_step(c):
    return jnp.tanh(c @ W)


def promoting_step(c):
    return jnp.tanh(c) + B  # (2, 3) + (3,): an implicit rank promotion


def precisions(jaxpr):
    """The ``precision`` of every ``dot_general`` in ``jaxpr``, the loops' steps and every
    jaxpr nested in a parameter included."""
    found = []

    def walk(j):
        j = getattr(j, "jaxpr", j)
        for eqn in j.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(eqn.params["precision"])
            for value in eqn.params.values():
                for v in value if isinstance(value, tuple | list) else [value]:
                    if hasattr(v, "step_jaxpr"):  # a dyndepth loop
                        walk(v.step_jaxpr)
                    elif hasattr(v, "eqns") or hasattr(getattr(v, "jaxpr", None), "eqns"):
                        walk(v)

    walk(jaxpr)
    return found


def is_highest(precision):
    parts = precision if isinstance(precision, tuple) else (precision,)
    return bool(parts) and all(p == jax.lax.Precision.HIGHEST for p in parts)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_matmul_precision_after_a_first_call(strategy):
    def run(x):
        return dd.repeat(matmul_step, x, 2, max_depth=3, strategy=strategy)

    run(X)  # traced and cached at the default precision
    default = precisions(jax.make_jaxpr(run)(X))
    assert default and not any(is_highest(p) for p in default)
    with jax.default_matmul_precision("highest"):
        highest = precisions(jax.make_jaxpr(run)(X))
        run(X)
    assert highest and all(is_highest(p) for p in highest), highest
    # and back: the default again
    assert not any(is_highest(p) for p in precisions(jax.make_jaxpr(run)(X)))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_rank_promotion_raise_after_a_first_call(strategy):
    def run(x):
        return dd.repeat(promoting_step, x, 2, max_depth=3, strategy=strategy)

    run(X)
    with jax.numpy_rank_promotion("raise"):
        with pytest.raises(ValueError, match="jax_numpy_rank_promotion='raise'"):
            run(X)
        with pytest.raises(ValueError, match="jax_numpy_rank_promotion='raise'"):
            dd.scan(lambda c, x: (promoting_step(c), x), X, jnp.ones(3), depth=2)
    run(X)  # allowed again


def test_the_library_itself_promotes_no_rank():
    """Under ``numpy_rank_promotion("raise")``, a step that promotes nothing runs through
    every transformation (the kernels' own code promotes no rank either)."""

    def step(c):
        return jnp.tanh(c @ W) + B[None, :]

    def loss(x, d):
        return jnp.sum(jax.vmap(lambda x, d: dd.repeat(step, x, d, max_depth=3))(x, d))

    xs, ds = jnp.ones((4, 2, 3)), jnp.array([0, 1, 3, 2], jnp.int32)
    with jax.numpy_rank_promotion("raise"):
        jax.jit(jax.grad(loss))(xs, ds)
        jax.jit(jax.hessian(lambda x: loss(x, ds)))(xs[:, :1])


def test_trace_context_changes_with_the_options():
    base = _compat.trace_context()
    with jax.default_matmul_precision("highest"):
        assert _compat.trace_context() != base
    with jax.numpy_rank_promotion("raise"):
        assert _compat.trace_context() != base
    assert _compat.trace_context() == base
