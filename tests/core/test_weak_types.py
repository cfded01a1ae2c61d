"""Weak types and Python scalars in the step, as ``lax`` loops treat them (issue 29).

``lax.while_loop``/``lax.scan`` accept a step that returns a Python scalar or a weakly typed
value for a carry leaf of that dtype, keep a weakly typed ``init`` leaf weak inside the step when
the step returns its dtype, and return weakly typed outputs where the step's are. Under strict
dtype promotion (tests/conftest.py) that decides which programs type-check, so dyndepth must
agree with ``lax`` leaf by leaf: value, dtype and weak type.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import applicable, reference_repeat, tree_allclose
from jax import lax
from shared_lists import STRATEGIES

import dyndepth as dd


def typed(tree):
    """Each leaf's (dtype, weak type): what strict promotion sees."""
    return [(jnp.dtype(a.dtype), bool(a.weak_type)) for a in jax.tree_util.tree_leaves(tree)]


def lax_repeat(f, init, depth):
    return lax.fori_loop(0, depth, lambda i, c: f(c), init)


# (step, init): each returns a Python scalar or a weakly typed value somewhere.
STEPS = {
    "python float for a float32 carry": (lambda c: 1.5, jnp.float32(0.0)),
    "python int for an int32 carry": (lambda c: 7, jnp.int32(0)),
    "python float for a Python-scalar carry": (lambda c: 2.5, 0.0),
    "weak array for a float32 carry": (lambda c: jnp.asarray(3.0), jnp.float32(1.0)),
    "weak carry kept weak": (lambda c: c * 2 + 1, 1.0),
    "tuple with a python int leaf": (lambda c: (c[0] + 1.0, 0), (jnp.float32(0), jnp.int32(5))),
    "weak int carry": (lambda c: c + 1, 0),
}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", list(STEPS))
def test_python_scalar_and_weak_steps_match_lax(name, strategy):
    f, init = STEPS[name]
    for depth in (0, 3):
        got = jax.jit(lambda d=depth: dd.repeat(f, init, d, max_depth=4, strategy=strategy))()
        want = lax_repeat(f, init, depth)
        tree_allclose(got, want, err_msg=f"{name} depth={depth}")
        assert typed(got) == typed(want), (name, depth, typed(got), typed(want))


def test_python_scalars_in_while_loop_and_scan():
    got = dd.while_loop(lambda c: c < 3.0, lambda c: c + 1, 0.0, max_steps=5)
    want = lax.while_loop(lambda c: c < 3.0, lambda c: c + 1, 0.0)
    tree_allclose(got, want)
    assert typed(got) == typed(want)
    # a predicate that returns a Python bool, a body that returns a Python float
    got = dd.while_loop(lambda c: True, lambda c: 4.0, jnp.float32(0), max_steps=2)
    assert typed(got) == [(jnp.dtype("float32"), True)] and float(got) == 4.0
    carry, ys = dd.scan(lambda c, x: (c + x, 1.0), 0.0, jnp.arange(3.0), depth=2)
    l_carry, l_ys = lax.scan(lambda c, x: (c + x, 1.0), 0.0, jnp.arange(3.0))
    tree_allclose(carry, jnp.float32(1.0))
    tree_allclose(ys, jnp.array([1.0, 1.0, 0.0]))
    assert typed((carry, ys)) == typed((l_carry, l_ys))


def test_python_int_step_for_float_carry_is_cast():
    # lax rejects it; a weak int fits a float carry without loss, so it is cast
    out = dd.repeat(lambda c: 1, jnp.float32(0), 2, max_depth=3)
    tree_allclose(out, jnp.float32(1.0))


def test_lossy_weak_return_still_raises():
    with pytest.raises(TypeError, match=r"carry<root> the input is int32\[\] but `f` returned"):
        dd.repeat(lambda c: 1.5, jnp.int32(0), 2, max_depth=3)
    with pytest.raises(TypeError, match=r"the input is float32\[3\] but `f` returned float32\[\]"):
        dd.repeat(lambda c: 1.5, jnp.zeros(3), 2, max_depth=3)


# Programs that type-check under strict promotion only if the weak carry stays weak inside the
# step, or the loop's output stays weak (each also runs with lax, as checked).
STRICT = {
    "weak carry times bfloat16 xs": lambda scan: scan(
        lambda c, x: (c * 2, c + x), 0.0, jnp.arange(3, dtype=jnp.bfloat16)
    ),
    "weak float output times bfloat16": lambda scan: jax.tree_util.tree_map(
        lambda a: a * jnp.bfloat16(2), scan(lambda c, x: (c + 1.0, None), 0.0, None, 3)
    ),
    "weak int output times int8": lambda scan: jax.tree_util.tree_map(
        lambda a: a * jnp.int8(2), scan(lambda c, x: (c + 1, None), 0, None, 3)
    ),
    "mixed weak int and int16 leaves": lambda scan: scan(
        lambda c, x: ((c[0] + 1, c[1] * c[0]), None), (1, jnp.int16(3)), None, 3
    ),
}


def _lax_scan(f, init, xs, length=None):
    return lax.scan(f, init, xs, length=length)


@pytest.mark.parametrize("strategy", ["auto", "masked"])
@pytest.mark.parametrize("name", list(STRICT))
def test_strict_promotion_with_weak_types(name, strategy):
    assert jax.config.jax_numpy_dtype_promotion == "strict"

    def dd_scan(f, init, xs, length=None):
        return dd.scan(f, init, xs, length=length, depth=length or 3, strategy=strategy)

    got = jax.jit(lambda: STRICT[name](dd_scan))()
    want = STRICT[name](_lax_scan)
    tree_allclose(got, want, rtol=1e-2, atol=1e-2, err_msg=name)
    assert typed(got) == typed(want), name


@pytest.mark.parametrize("strategy", ["auto", "checkpointed", "masked"])
def test_weak_carry_under_grad_and_vmap(strategy):
    # A Python-scalar init and a weakly typed step output, differentiated and batched.
    def f(w, d):
        return dd.repeat(lambda c: jnp.sin(c * w) + 0.5, 1.0, d, max_depth=4, strategy=strategy,
                         **applicable(strategy))  # fmt: skip

    def ref(w, d):
        return reference_repeat(lambda c: jnp.sin(c * w) + 0.5, 1.0, d)

    ws, ds = jnp.array([0.3, -0.7, 1.1]), jnp.array([2, 0, 4], jnp.int32)
    got = jax.jit(jax.vmap(jax.value_and_grad(f)))(ws, ds)
    want = [jax.value_and_grad(ref)(w, int(d)) for w, d in zip(ws, ds, strict=True)]
    tree_allclose(got, jax.tree_util.tree_map(lambda *r: jnp.stack(r), *want))
    g = jax.jit(jax.grad(lambda w: jnp.sum(jax.vmap(f, (None, 0))(w, ds))))(0.4)
    tree_allclose(g, sum(jax.grad(ref)(0.4, int(d)) for d in ds))
