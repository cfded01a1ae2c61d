"""The private JAX names behind ``dyndepth._compat``, hidden: every fallback runs and the loops
still equal the plain-Python references.

A name that JAX itself reads (its devices registry, an equation's context, a primitive's
``get_bind_params``) cannot be deleted from JAX without breaking JAX; those are hidden from
dyndepth's view (``_compat.PRIVATE`` pointed at a name that does not exist), as a JAX release
that renamed them would. ``unsafe_get_axis_names_DO_NOT_USE`` and ``lax.axis_size`` JAX does not
read through their modules: those are deleted for real.
"""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import pytest
from helpers import (
    reference_repeat,
    reference_scan,
    reference_while,
    run_on_eight_devices,
    tree_allclose,
)
from jax import lax

import dyndepth as dd
from dyndepth import _compat

M = 5
W = jax.random.normal(jax.random.PRNGKey(0), (3, 3)) * 0.6
X = jax.random.normal(jax.random.PRNGKey(1), (4, 3))
DEPTHS = jnp.array([2, 0, M, 3], jnp.int32)
KEYS = jax.random.split(jax.random.PRNGKey(2), 4)
SEQ = jax.random.normal(jax.random.PRNGKey(3), (M, 3))


def hide(monkeypatch, *names):
    """Point the ``_compat.PRIVATE`` entries ``names`` at an attribute that does not exist."""
    for name in names:
        monkeypatch.setitem(_compat.PRIVATE, name, ("_hidden_by_the_test",))


def step(W, c, k):
    # jax.nn.relu is a custom_jvp call and the inner jit a call: both are bound again when the
    # step runs inside shard_map (the get_bind_params fallback inlines them)
    h = jax.jit(lambda v: jnp.tanh(v @ W))(c)
    return jnp.where(jax.random.bernoulli(k, 0.8, c.shape), jax.nn.relu(h), 0.0) + 0.5 * c


def loops(W, xs, ds, ks):
    """Per-sample loops of every kind: vmap of repeat, scan and while_loop, repeat_batched."""
    f = lambda c, k: step(W, c, k)  # noqa: E731
    r = jax.vmap(lambda x, d, k: dd.repeat(f, x, d, max_depth=M, key=k))(xs, ds, ks)
    g = lambda c, x, k: (step(W, c, k) + x, jnp.sum(c))  # noqa: E731
    s = jax.vmap(lambda x, d, k: dd.scan(g, x, SEQ, depth=d, key=k))(xs, ds, ks)
    cond = lambda c: jnp.sum(c**2) < 2.0  # noqa: E731
    w = jax.vmap(lambda x, k: dd.while_loop(cond, f, x, max_steps=M, key=k))(xs * 0.5, ks)
    b = dd.repeat_batched(f, xs, ds, max_depth=M, keys=ks)
    return r, s, w, b


def reference_loops(W, xs, ds, ks):
    f = lambda c, k: step(W, c, k)  # noqa: E731
    g = lambda c, x, k: (step(W, c, k) + x, jnp.sum(c))  # noqa: E731
    cond = lambda c: jnp.sum(c**2) < 2.0  # noqa: E731
    rows = range(xs.shape[0])
    r = jnp.stack([reference_repeat(f, xs[i], int(ds[i]), ks[i]) for i in rows])
    s = [reference_scan(g, xs[i], SEQ, int(ds[i]), M, ks[i]) for i in rows]
    s = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *s)
    w = jnp.stack([reference_while(cond, f, xs[i] * 0.5, M, ks[i])[0] for i in rows])
    return r, s, w, r


def loss(run):
    return lambda W: sum(jnp.sum(leaf**2) for leaf in jax.tree_util.tree_leaves(run(W)))


EVERY_NAME = tuple(_compat.PRIVATE)


@pytest.mark.parametrize("where", ["plain", "shard_map"])
def test_loops_equal_the_references_with_every_private_name_hidden(monkeypatch, where):
    """Values and gradients under jit, and inside a one-device ``shard_map`` (where each step is
    evaluated again by dyndepth's jaxpr interpreter: the equation-context and bind fallbacks)."""
    want_v = reference_loops(W, X, DEPTHS, KEYS)
    want_g = jax.grad(loss(lambda W: reference_loops(W, X, DEPTHS, KEYS)))(W)
    hide(monkeypatch, *EVERY_NAME)
    monkeypatch.delattr(jax.extend.core, "unsafe_get_axis_names_DO_NOT_USE", raising=False)
    monkeypatch.delattr(lax, "axis_size", raising=False)
    run = loops
    if where == "shard_map":
        mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
        spec = jax.P("data")
        run = jax.shard_map(loops, mesh=mesh, in_specs=(jax.P(), spec, spec, spec),
                            out_specs=spec)  # fmt: skip
    got_v = jax.jit(run)(W, X, DEPTHS, KEYS)
    got_g = jax.jit(jax.grad(loss(lambda W: run(W, X, DEPTHS, KEYS))))(W)
    tree_allclose(got_v, want_v, rtol=1e-5, atol=1e-5)
    tree_allclose(got_g, want_g, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("hidden", ["none", "public", "public and private"])
def test_a_step_using_the_vmap_axis_runs_in_lockstep(monkeypatch, hidden):
    """The one fallback that changes what runs: which axis names a step's collective uses. A
    step normalising over the batch (``lax.pmean`` over the vmap axis) must see every sample at
    every step (the lockstep loop); one whose collective is over an axis of its own (an inner
    vmap) need not. With ``lax.axis_size`` and the private list hidden, every name counts as the
    batch's: the same values."""
    if hidden != "none":
        monkeypatch.delattr(lax, "axis_size", raising=False)
    if hidden == "public and private":
        monkeypatch.delattr(jax.extend.core, "unsafe_get_axis_names_DO_NOT_USE", raising=False)

    def centred(c):  # uses the batch: every sample at every step
        return jnp.tanh(c @ W) - lax.pmean(jnp.tanh(c @ W), "batch")

    def own_axis(c):  # a collective over an axis the step binds itself
        return jax.vmap(lambda r: jnp.tanh(r @ W) - lax.pmean(r, "rows"), axis_name="rows")(
            c[None]
        )[0]

    got = jax.vmap(lambda x, d: dd.repeat(centred, x, d, max_depth=M), axis_name="batch")(X, DEPTHS)
    # The lockstep meaning: at step i, the samples whose depth is above i step, and the mean is
    # over every sample's tanh(c @ W) at that step (the masked loop's).
    c = X
    for i in range(M):
        t = jnp.tanh(c @ W)
        c = jnp.where((DEPTHS > i)[:, None], t - t.mean(0), c)
    tree_allclose(got, c)
    got = jax.vmap(lambda x, d: dd.repeat(own_axis, x, d, max_depth=M))(X, DEPTHS)
    want = jnp.stack([reference_repeat(own_axis, X[i], int(DEPTHS[i])) for i in range(4)])
    tree_allclose(got, want)


def test_bound_axes_fallbacks(monkeypatch):
    def names_in_vmap():
        out = {}
        jax.vmap(lambda x: out.setdefault("b", _compat.bound_axes({"i", "j"})) and x,
                 axis_name="i")(jnp.ones(2))  # fmt: skip
        return out["b"]

    assert names_in_vmap() == {"i"}
    monkeypatch.delattr(lax, "axis_size", raising=False)
    assert names_in_vmap() == {"i"}  # the private list
    monkeypatch.delattr(jax.extend.core, "unsafe_get_axis_names_DO_NOT_USE", raising=False)
    assert names_in_vmap() == {"i", "j"}  # every name counts as bound


def test_devices_registry_fallback(monkeypatch):
    from jax._src import dispatch

    p = jax.extend.core.Primitive("dyndepth_test_compat")
    hide(monkeypatch, "devices_registry")
    assert _compat.require_devices_when_lowered(p) is False
    assert p not in dispatch.prim_requires_devices_during_lowering
    monkeypatch.undo()
    assert _compat.require_devices_when_lowered(p) is True
    assert p in dispatch.prim_requires_devices_during_lowering
    dispatch.prim_requires_devices_during_lowering.discard(p)


AUTO_MESH_SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax._src import dispatch
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import dyndepth as dd
    from dyndepth import _compat, _primitives

    # As on a JAX without the private devices registry: the loops were never registered, and
    # the lowering context's devices are not found.
    dispatch.prim_requires_devices_during_lowering.difference_update(
        {_primitives.loop_p, _primitives.bwd_p})
    _compat.PRIVATE["devices_registry"] = ("_hidden_by_the_test",)
    _compat.PRIVATE["device_assignment"] = ("_hidden_by_the_test",)

    B, D, T = 16, 4, 6
    W = jax.random.normal(jax.random.PRNGKey(0), (D, D)) / 2
    xs = jax.random.normal(jax.random.PRNGKey(1), (B, D))
    ds = jax.random.randint(jax.random.PRNGKey(2), (B,), 0, T + 1)

    def loss(W, xs, ds):
        f = lambda c: jnp.tanh(c @ W) + 0.5 * c
        r = jax.vmap(lambda x, d: dd.repeat(f, x, d, max_depth=T))(xs, ds)
        b = dd.repeat_batched(f, xs, ds, max_depth=T)
        return jnp.sum(r ** 2) + jnp.sum(b ** 2)

    def reference(W):
        total = 0.0
        for x, d in zip(xs, ds.tolist()):
            for _ in range(d):
                x = jnp.tanh(x @ W) + 0.5 * x
            total = total + 2 * jnp.sum(x ** 2)
        return total

    v0, g0 = jax.value_and_grad(reference)(W)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    put = lambda a, *s: jax.device_put(a, NamedSharding(mesh, P(*s)))
    v, g = jax.jit(jax.value_and_grad(loss))(put(W), put(xs, "data"), put(ds, "data"))
    print("RESULT" + json.dumps(dict(value_err=float(abs(v - v0) / abs(v0)),
                                     grad_err=float(jnp.max(abs(g - g0)) / jnp.max(abs(g0))))))
    """
)


def test_auto_mesh_without_the_devices_registry():
    """On 8 devices, an ``Auto`` mesh under plain ``jit``: without the private registry the
    loops are not split per device, and still equal the reference (no hang, no error)."""
    r = run_on_eight_devices(AUTO_MESH_SCRIPT)
    assert r["value_err"] < 1e-5 and r["grad_err"] < 1e-5, r


def test_lowered_for_export_fallback(monkeypatch):
    """The export flag read from a lowering context, and False when the context lacks it."""

    class Params:
        for_export = True

    class ModuleContext:
        lowering_parameters = Params()

    class Ctx:
        module_context = ModuleContext()

    assert _compat.lowered_for_export(Ctx()) is True
    hide(monkeypatch, "for_export")
    assert _compat.lowered_for_export(Ctx()) is False


def test_trace_context_fallback(monkeypatch):
    """Without JAX's ``trace_context``, the public options that change a trace: a step traced
    under one matmul precision or rank promotion is still not reused under another."""
    hide(monkeypatch, "trace_context")
    base = _compat.trace_context()
    assert base == tuple(getattr(jax.config, n) for n in _compat.TRACE_OPTIONS)
    with jax.default_matmul_precision("highest"):
        assert _compat.trace_context() != base
    with jax.numpy_rank_promotion("raise"):
        assert _compat.trace_context() != base


def test_jaxprs_in_params_without_jax_extends(monkeypatch):
    """Before jax 0.10 (the floor is 0.9.2), ``jax.extend.core`` has no ``jaxprs_in_params``:
    the fallback walks the parameters itself and finds the same jaxprs."""

    def f(x):
        y = jax.lax.cond(x > 0, jnp.sin, jnp.cos, x)
        return jax.lax.scan(lambda c, _: (c * y, None), x, None, length=2)[0]

    eqns = jax.make_jaxpr(f)(1.0).jaxpr.eqns
    public = [list(jax.extend.core.jaxprs_in_params(e.params)) for e in eqns]
    monkeypatch.delattr(jax.extend.core, "jaxprs_in_params")
    fallback = [_compat.jaxprs_in_params(e.params) for e in eqns]
    assert [[id(j) for j in js] for js in fallback] == [[id(j) for j in js] for js in public]
    assert sum(map(len, fallback)) == 3  # the cond's two branches, the scan's body
