"""Reverse over reverse wherever something stands between the two differentiations (issue 40,
item 1): a ``jit`` between or around them, a ``vjp``, the loop inside ``lax.cond``,
``lax.scan``, ``lax.map``, ``jax.checkpoint`` or another dyndepth loop's step, ``rbg`` keys
under ``vmap`` (which run one sample at a time, in a ``lax.map``), and an ``Explicit`` mesh.
Each against the plain-Python loop, for every strategy that has reverse mode; ``"while"``
raises its documented error. JAX's own ``testScanGrad`` (tests/lax_control_flow_test.py) in its
four ``jit`` forms closes the file.
"""

from __future__ import annotations

import functools
import itertools
import textwrap

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from helpers import reference_repeat, reference_scan, run_on_eight_devices, tree_allclose
from shared_lists import (
    CHECKPOINTING_STRATEGIES,
    FULL,
    GRAD_STRATEGIES,
    RBG_IMPLS,
    covering,
)

import dyndepth as dd

TOL = dict(rtol=1e-4, atol=1e-5)
X = jnp.array([0.3, -0.2, 0.5])


def loss_for(strategy, depth=3, max_depth=5):
    def loss(a):
        return jnp.sum(dd.repeat(lambda c: jnp.sin(c) * a, X, depth, max_depth=max_depth,
                                 strategy=strategy))  # fmt: skip

    return loss


def reference_loss(a, depth=3, x=X):
    return jnp.sum(reference_repeat(lambda c: jnp.sin(c) * a, x, depth))


def _scan_twice(g):
    return lambda a: jax.lax.scan(lambda c, _: (c + g(a), None), 0.0, None, length=2)[0]


FORMS = {
    "grad(jit(grad))": lambda g: jax.grad(jax.jit(jax.grad(g))),
    "grad(grad(jit))": lambda g: jax.grad(jax.grad(jax.jit(g))),
    "jit(grad(grad))": lambda g: jax.jit(jax.grad(jax.grad(g))),
    "grad(vjp(jit))": lambda g: jax.grad(lambda a: jax.vjp(jax.jit(g), a)[1](1.0)[0]),
    "grad(jit(vjp(jit)))": lambda g: jax.grad(
        jax.jit(lambda a: jax.vjp(jax.jit(g), a)[1](1.0)[0] ** 2)
    ),
    "grad(cond(grad))": lambda g: jax.grad(
        lambda a: jax.lax.cond(a > 0, jax.grad(g), lambda a: a, a)
    ),
    "grad(grad(cond))": lambda g: jax.grad(
        jax.grad(lambda a: jax.lax.cond(a > 0, g, lambda a: a, a))
    ),
    "grad(grad(scan))": lambda g: jax.grad(jax.grad(_scan_twice(g))),
    "grad(scan(grad))": lambda g: jax.grad(_scan_twice(jax.grad(g))),
    "grad(grad(map))": lambda g: jax.grad(
        jax.grad(lambda a: jnp.sum(jax.lax.map(g, jnp.stack([a, 2 * a]))))
    ),
    "grad(grad(checkpoint))": lambda g: jax.grad(jax.grad(jax.checkpoint(g))),
    "grad(checkpoint(grad))": lambda g: jax.grad(jax.checkpoint(jax.grad(g))),
    "grad(grad(grad(jit)))": lambda g: jax.grad(jax.grad(jax.grad(jax.jit(g)))),
    "jacrev(jit(grad))": lambda g: jax.jacrev(jax.jit(jax.grad(g))),
    "hessian(jit)": lambda g: jax.hessian(jax.jit(g)),
    "jacfwd(jit(grad))": lambda g: jax.jacfwd(jax.jit(jax.grad(g))),
}


# Each form under one strategy of a backward pass of its own, the two turning; every form under
# every strategy with DYNDEPTH_FULL=1 ("masked" is JAX's differentiation of a masked loop).
FORM_CASES = covering(list(FORMS), GRAD_STRATEGIES if FULL else CHECKPOINTING_STRATEGIES,
                      crossed=1)  # fmt: skip


@pytest.mark.parametrize(("form", "strategy"), FORM_CASES)
def test_second_order_forms_equal_the_plain_loop(form, strategy):
    transform = FORMS[form]
    for depth in (0, 3, 5):
        got = transform(loss_for(strategy, depth))(0.7)
        want = transform(functools.partial(reference_loss, depth=depth))(0.7)
        tree_allclose(got, want, **TOL, err_msg=f"{form} {strategy} depth {depth}")


BATCH_FORMS = {
    "hessian": jax.hessian,
    "jacfwd(grad)": lambda g: jax.jacfwd(jax.grad(g)),
    "grad(grad)": lambda g: jax.grad(jax.grad(g)),
    "grad(jvp)": lambda g: jax.grad(lambda a: jax.jvp(g, (a,), (1.0,))[1]),
}
XB = jnp.array([[0.3, -0.2], [0.5, 0.1], [-0.4, 0.2], [0.25, -0.6], [0.1, 0.4]])
DB = jnp.array([3, 0, 5, 2, 4])


BATCH_CASES = covering(list(BATCH_FORMS), [5, 2], [None, 2])


@pytest.mark.parametrize(("form", "slots", "checkpoints"), BATCH_CASES,
                         ids=[f"{f}-{'lockstep' if s == 5 else 'wrap-around'}-K{k}"
                              for f, s, k in BATCH_CASES])  # fmt: skip
def test_second_order_of_a_scheduled_batch(form, slots, checkpoints):
    """Every second-order form of a batch on each schedule, every carry stored or thinned,
    against the plain-Python loop per sample (the stored carries' reads are differentiated
    too: forward over reverse perturbs them)."""

    def loss(a):
        out = dd.repeat_batched(lambda c: jnp.sin(c) * a, XB, DB, max_depth=5, slots=slots,
                                checkpoints=checkpoints)  # fmt: skip
        return jnp.sum(out)

    def ref(a):
        return sum(reference_loss(a, int(d), x) for x, d in zip(XB, DB, strict=True))

    transform = BATCH_FORMS[form]
    tree_allclose(transform(loss)(0.7), transform(ref)(0.7), **TOL)


@pytest.mark.parametrize("form", [f for f in FORMS if "hessian" not in f and "jacfwd" not in f])
def test_while_strategy_raises_its_reverse_mode_error(form):
    with pytest.raises(TypeError, match='strategy="while" supports forward-mode'):
        FORMS[form](loss_for("while"))(0.7)


@pytest.mark.parametrize(("outer", "inner"), [("auto", "checkpointed"), ("checkpointed", "auto"),
                                              ("masked", "auto"), ("auto", "masked")])  # fmt: skip
def test_loop_inside_another_loops_step(outer, inner):
    """A dyndepth loop in the step of another, both differentiated twice, one ``jit`` between."""

    def step(c, a, run):
        return run(lambda h: jnp.tanh(h * a + c), c, 2)

    def dd_run(strategy):
        return lambda f, c, d: dd.repeat(f, c, d, max_depth=3, strategy=strategy)

    def loss(a, run_in, run_out):
        return jnp.sum(run_out(lambda c: step(c, a, run_in), X, 3) ** 2)

    got_loss = functools.partial(loss, run_in=dd_run(inner), run_out=dd_run(outer))
    ref_loss = functools.partial(loss, run_in=reference_repeat, run_out=reference_repeat)
    for name in ("grad(jit(grad))", "grad(grad(jit))", "grad(grad(scan))"):
        tree_allclose(FORMS[name](got_loss)(0.4), FORMS[name](ref_loss)(0.4), **TOL, err_msg=name)


@pytest.mark.parametrize(("impl", "strategy"),
                         covering(RBG_IMPLS, CHECKPOINTING_STRATEGIES, crossed=1))  # fmt: skip
def test_vmapped_loop_with_rbg_keys(impl, strategy):
    """``rbg`` keys under ``vmap`` run one sample at a time inside the library's own
    ``lax.map``, which hid the outer reverse pass."""
    xs = jax.random.normal(jax.random.key(1), (3, 2))
    depths = jnp.array([2, 0, 3], jnp.int32)
    keys = jax.random.split(jax.random.key(5, impl=impl), 3)

    def step(a):
        return lambda c, k: jnp.sin(c * a) + 0.1 * jax.random.normal(k, c.shape)

    def loss(a):
        run = lambda x, d, k: dd.repeat(step(a), x, d, max_depth=3, key=k, strategy=strategy)
        return jnp.sum(jax.vmap(run)(xs, depths, keys) ** 2)

    def ref(a):
        outs = [reference_repeat(step(a), xs[b], d, key=keys[b]) for b, d in enumerate([2, 0, 3])]
        return jnp.sum(jnp.stack(outs) ** 2)

    for name in ("grad(jit(grad))", "jit(grad(grad))", "grad(grad(checkpoint))"):
        tree_allclose(FORMS[name](loss)(0.8), FORMS[name](ref)(0.8), **TOL, err_msg=name)


EXPLICIT_SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P, AxisType
    import dyndepth as dd

    B, D, T = 8, 4, 5
    W = jax.random.normal(jax.random.key(0), (D, D)) / 2
    xs = jax.random.normal(jax.random.key(1), (B, D))
    ds = jnp.arange(B, dtype=jnp.int32) % (T + 1)

    def plain(W, x, n):
        for _ in range(int(n)):
            x = jnp.tanh(x @ W)
        return x

    def ref_loss(W):
        return jnp.sum(jnp.stack([plain(W, xs[b], ds[b]) for b in range(B)]) ** 2)

    penalty = lambda L: (lambda W, *a: jnp.sum(jax.grad(L)(W, *a) ** 2))
    want = jax.grad(penalty(ref_loss))(W)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    out = {}
    with jax.set_mesh(mesh):
        args = (jax.device_put(xs, P("data")), jax.device_put(ds, P("data")))
        for strategy in ["auto", "checkpointed", "masked"]:
            def loss(W, xs, ds):
                f = lambda x, n: dd.repeat(lambda c: jnp.tanh(c @ W), x, n, max_depth=T,
                                           strategy=strategy)
                return jnp.sum(jax.vmap(f)(xs, ds) ** 2)
            forms = dict(grad_grad=jax.jit(jax.grad(penalty(loss))),
                         grad_jit_grad=jax.jit(jax.grad(jax.jit(penalty(loss)))))
            for name, f in forms.items():
                got = f(jax.device_put(W, P()), *args)
                out[strategy + "/" + name] = float(jnp.max(abs(got - want)) / jnp.max(abs(want)))
    print("RESULT" + json.dumps(out))
    """
)


def test_grad_grad_of_a_vmapped_loop_on_an_explicit_mesh():
    """Was "Resource axis: data ... not found in mesh: ()" (a constant in the ``"masked"``
    loop's state, which the second differentiation runs)."""
    results = run_on_eight_devices(EXPLICIT_SCRIPT)
    assert len(results) == 6
    for name, err in results.items():
        assert err < 1e-5, (name, err)


# ----------------------------------------------------------------------------- JAX's testScanGrad


def scan_step(d):
    def f(c, a):
        b = jnp.sum(jnp.sin(a)) + jnp.sum(jnp.sin(c)) + jnp.sum(jnp.sin(d))
        return jnp.sin(c * b), b

    return f


# (every jit form under every strategy, the depth turning; both depths with DYNDEPTH_FULL=1)
SCAN_CASES = [(*jits, strategy, depth) for jits, strategy, depth
              in covering(list(itertools.product([False, True], [False, True])),
                          GRAD_STRATEGIES, [5, 3])]  # fmt: skip


@pytest.mark.parametrize(("jit_scan", "jit_f", "strategy", "depth"), SCAN_CASES,
                         ids=[f"jit_scan={a}-jit_f={b}-{s}-depth{d}"
                              for a, b, s, d in SCAN_CASES])  # fmt: skip
def test_jax_scan_grad(jit_scan, jit_f, strategy, depth):
    """JAX's ``testScanGrad`` with ``dyndepth.scan`` (``depth`` of the 5 steps): the gradient,
    and reverse over reverse (the vjp of the vjp, as ``check_grads(order=2, modes=["rev"])``
    takes it), exact against the plain loop; then ``check_grads`` itself."""
    rng = np.random.RandomState(0)
    f = scan_step(jnp.asarray(rng.randn(2), jnp.float32))
    as_ = jnp.asarray(rng.randn(5, 3), jnp.float32)
    c = jnp.asarray(rng.randn(4), jnp.float32)

    def scan(f, c, as_):
        return dd.scan(f, c, as_, depth=depth, strategy=strategy)

    def scan_reference(f, c, as_):
        return reference_scan(f, c, as_, depth, 5)

    if jit_f:
        f = jax.jit(f)
    if jit_scan:
        scan = jax.jit(scan, static_argnums=(0,))

    def first(run):
        return jax.grad(lambda c, as_: list(run(f, c, as_))[0].sum(), (0, 1))

    tree_allclose(first(scan)(c, as_), first(scan_reference)(c, as_), **TOL)

    def second(run, c, as_):  # (the vjp of the vjp: with respect to the inputs and cotangent)
        def pulled(c, as_, ct):
            return jax.vjp(lambda c, as_: run(f, c, as_), c, as_)[1](ct)

        ct = (jnp.cos(c), jnp.linspace(-1.0, 1.0, 5))
        out, pull = jax.vjp(pulled, c, as_, ct)
        return pull(jax.tree_util.tree_map(jnp.sin, out))

    tree_allclose(second(scan, c, as_), second(scan_reference, c, as_), **TOL)
    jax.test_util.check_grads(functools.partial(scan, f), (c, as_), order=2, modes=["rev"],
                              atol=1e-3, rtol=5e-3)  # fmt: skip
