"""Reverse over reverse (``jax.grad`` of ``jax.grad``, ``jax.jacrev`` of ``jax.grad``, gradient
penalties, meta-learning) through every loop, against the plain-Python references of the
transform matrix (tests/core/test_transform_matrix.py).

The backward pass's derivative is transposed as the ``"masked"`` loop's (plain ``lax``, every
order JAX's own) wherever the outer reverse pass is: around the inner one, or hidden from it by a
``jit``, a ``vjp``, a ``lax.cond`` or a ``jax.checkpoint`` (the transforms below). The cases run
through each second-order transform, the configuration rotating, so that every case meets
several configurations and every transform several cases.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest
import test_transform_matrix as tm
from helpers import reference_repeat, tree_allclose
from shared_lists import CHECKPOINTING_STRATEGIES, cfg_id

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


def hiding(vmap):
    """``(jit, cond, checkpoint)`` for the dyndepth side; for the reference (``vmap`` the Python
    loop, which needs concrete depths), plain calls: the same functions, untraced."""
    if vmap is jax.vmap:
        return jax.jit, jax.lax.cond, jax.checkpoint
    return (lambda f: f), (lambda pred, f, g, x: f(x) if pred else g(x)), (lambda f: f)


def t_grad_jit_grad(vmap, fn, p, args):
    """The penalty's inner gradient jitted: the outer reverse pass sees a jitted derivative."""

    def penalty(p):
        jit = hiding(vmap)[0]
        return tree_sq(jit(jax.grad(lambda q: tm.loss(fn(q, *tm.first(args)))))(p))

    return jax.grad(penalty)(p)


def t_grad_grad_jit_vmap(vmap, fn, p, args):
    """Both differentiations outside a jitted batched loss."""
    f = hiding(vmap)[0](lambda q: tm.loss(vmap(fn, tm.axes(args))(q, *tm.head(args))))
    return jax.grad(lambda p: tree_sq(jax.grad(f)(p)))(p)


def t_grad_vjp_jit(vmap, fn, p, args):
    """A jitted loss inside a vjp inside a gradient."""

    def penalty(p):
        _, pull = jax.vjp(hiding(vmap)[0](lambda q: tm.loss(fn(q, *tm.first(args)))), p)
        return tree_sq(pull(jnp.float32(1.0)))

    return jax.grad(penalty)(p)


def t_grad_cond_grad(vmap, fn, p, args):
    """The inner gradient inside a ``lax.cond`` branch."""

    def penalty(p):
        cond = hiding(vmap)[1]
        g = cond(True, jax.grad(lambda q: tm.loss(fn(q, *tm.first(args)))), lambda q: q, p)
        return tree_sq(g)

    return jax.grad(penalty)(p)


def t_grad_checkpoint_grad(vmap, fn, p, args):
    """The inner gradient under ``jax.checkpoint``."""

    def penalty(p):
        checkpoint = hiding(vmap)[2]
        g = jax.grad(lambda q: tm.loss(vmap(fn, tm.axes(args))(q, *tm.head(args))))
        return tree_sq(checkpoint(g)(p))

    return jax.grad(penalty)(p)


TRANSFORMS = {
    "grad(grad)": t_grad_grad,
    "grad(vmap(grad))": t_grad_vmap_grad,
    "vmap(grad(grad))": t_vmap_grad_grad,
    "grad(grad(vmap))": t_grad_grad_vmap,
    "jacrev(grad)": t_jacrev_grad,
    "grad(jit(grad))": t_grad_jit_grad,
    "grad(grad(jit(vmap)))": t_grad_grad_jit_vmap,
    "grad(vjp(jit))": t_grad_vjp_jit,
    "grad(cond(grad))": t_grad_cond_grad,
    "grad(checkpoint(grad(vmap)))": t_grad_checkpoint_grad,
}
CONFIGS = [("auto", None), ("checkpointed", 2), ("checkpointed", None), ("auto", 2),
           ("auto", 2, "within")]  # fmt: skip
# Every case under every transform with DYNDEPTH_FULL=1 (make test-full); otherwise three
# cases per transform, rotating, so that every case meets three transforms.
COMBOS = [(t, c, CONFIGS[(i + j) % len(CONFIGS)])
          for j, t in enumerate(TRANSFORMS) for i, c in enumerate(tm.CASES)
          if os.environ.get("DYNDEPTH_FULL") == "1" or (i + j) % len(tm.CASES) < 3]  # fmt: skip


@pytest.mark.parametrize(("name", "case", "cfg"), COMBOS,
                         ids=[f"{n}-{c}-{cfg_id(k)}" for n, c, k in COMBOS])  # fmt: skip
def test_reverse_over_reverse_matrix(name, case, cfg):
    fn, _ = tm.CASES[case](*cfg[:2])
    _, ref = tm.CASES[case]("masked", None)
    args = tm.sample_args(case, tm.depths_of(cfg))
    transform = TRANSFORMS[name]
    got = jax.jit(lambda p, *a: transform(jax.vmap, fn, p, a))(tm.PARAMS, *args)
    want = transform(tm.python_vmap, ref, tm.PARAMS, args)
    tree_allclose(got, want, **TOL, err_msg=f"{case} {cfg_id(cfg)} {name}")


@pytest.mark.parametrize("strategy", CHECKPOINTING_STRATEGIES)
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
