"""Reverse over reverse (``jax.grad`` of ``jax.grad``, ``jax.jacrev`` of ``jax.grad``, gradient
penalties, meta-learning) through every loop, against the plain-Python references of the
transform matrix (tests/test_transform_matrix.py).

A loop differentiated inside an enclosing reverse-mode differentiation takes the derivative of
the ``"masked"`` loop (plain ``lax``, ``max_steps`` steps): every order then is JAX's own. The
cases run through each second-order transform once, the configuration rotating, so that every
case meets several configurations and every transform every case.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest
import test_transform_matrix as tm
from helpers import reference_repeat, tree_allclose

import dyndepth as dd

TOL = dict(rtol=1e-4, atol=1e-4)


def tree_sq(tree):
    return sum(jnp.sum(leaf**2) for leaf in jax.tree_util.tree_leaves(tree))


def t_grad_grad(vmap, fn, p, args):
    """A gradient penalty: the gradient of the squared gradient, one sample."""

    def penalty(p):
        return tree_sq(jax.grad(lambda q: tm.loss(fn(q, *tm.first(args))))(p))

    return jax.grad(penalty)(p)


def t_grad_vmap_grad(vmap, fn, p, args):
    """The gradient of a penalty on per-sample gradients."""

    def penalty(p):
        g = jax.grad(lambda q, *a: tm.loss(fn(q, *a)))
        return tree_sq(vmap(g, tm.axes(args))(p, *tm.head(args)))

    return jax.grad(penalty)(p)


def t_vmap_grad_grad(vmap, fn, p, args):
    """Per-sample gradients of a per-sample penalty."""

    def one(p, *a):
        return jax.grad(lambda p: tree_sq(jax.grad(lambda q: tm.loss(fn(q, *a)))(p)))(p)

    return vmap(one, tm.axes(args))(p, *tm.head(args))


def t_grad_grad_vmap(vmap, fn, p, args):
    """The gradient of the squared gradient of a batched loss."""

    def penalty(p):
        return tree_sq(jax.grad(lambda q: tm.loss(vmap(fn, tm.axes(args))(q, *tm.head(args))))(p))

    return jax.grad(penalty)(p)


def t_jacrev_grad(vmap, fn, p, args):
    """The Hessian by reverse over reverse, one sample."""
    return jax.jacrev(jax.grad(lambda q: tm.loss(fn(q, *tm.first(args)))))(p)


TRANSFORMS = {
    "grad(grad)": t_grad_grad,
    "grad(vmap(grad))": t_grad_vmap_grad,
    "vmap(grad(grad))": t_vmap_grad_grad,
    "grad(grad(vmap))": t_grad_grad_vmap,
    "jacrev(grad)": t_jacrev_grad,
}
CONFIGS = [("auto", None), ("checkpointed", 2), ("checkpointed", None), ("auto", 2)]
# Every case under every transform with DYNDEPTH_FULL=1 (make test-full); otherwise three
# cases per transform, rotating, so that every case meets three transforms.
COMBOS = [(t, c, CONFIGS[(i + j) % len(CONFIGS)])
          for j, t in enumerate(TRANSFORMS) for i, c in enumerate(tm.CASES)
          if os.environ.get("DYNDEPTH_FULL") == "1" or (i + j) % len(tm.CASES) < 3]  # fmt: skip


@pytest.mark.parametrize(("name", "case", "cfg"), COMBOS,
                         ids=[f"{n}-{c}-{tm.cfg_id(k)}" for n, c, k in COMBOS])  # fmt: skip
def test_reverse_over_reverse_matrix(name, case, cfg):
    fn, _ = tm.CASES[case](*cfg)
    _, ref = tm.CASES[case]("masked", None)
    args = tm.sample_args(case)
    transform = TRANSFORMS[name]
    got = jax.jit(lambda p, *a: transform(jax.vmap, fn, p, a))(tm.PARAMS, *args)
    want = transform(tm.python_vmap, ref, tm.PARAMS, args)
    tree_allclose(got, want, **TOL, err_msg=f"{case} {tm.cfg_id(cfg)} {name}")


@pytest.mark.parametrize("strategy", ["auto", "checkpointed"])
def test_grad_grad_eager_and_mixed_orders(strategy):
    x = jnp.array([0.3, -0.2, 0.5])

    def f(a, d=3):
        return jnp.sum(dd.repeat(lambda c: jnp.sin(c) * a, x, d, max_depth=4, strategy=strategy))

    def ref(a, d=3):
        return jnp.sum(reference_repeat(lambda c: jnp.sin(c) * a, x, d))

    for d in (0, 3, 4):
        tree_allclose(jax.grad(jax.grad(f))(0.7, d), jax.grad(jax.grad(ref))(0.7, d), **TOL)
    # third order: reverse over reverse over reverse, and forward over reverse over reverse
    g3 = jax.grad(jax.grad(jax.grad(f)))
    tree_allclose(g3(0.7), jax.grad(jax.grad(jax.grad(ref)))(0.7), **TOL)
    tree_allclose(jax.jacfwd(jax.grad(jax.grad(f)))(0.7), g3(0.7), **TOL)


def test_while_strategy_still_refuses_reverse_mode_under_grad_grad():
    def f(a):
        return jnp.sum(dd.repeat(lambda c: jnp.sin(c) * a, jnp.ones(2), 2, max_depth=3,
                                 strategy="while"))  # fmt: skip

    with pytest.raises(TypeError, match="checkpointed"):
        jax.grad(jax.grad(f))(0.7)
