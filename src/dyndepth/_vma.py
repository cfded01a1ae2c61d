"""Control flow that type-checks inside ``jax.shard_map``.

Inside ``shard_map`` (with its default ``check_vma=True``) every value records the manual mesh
axes it varies over, and ``lax.while_loop``/``scan``/``cond`` demand that a loop's state has the
same "varying" type going in and coming out. The engine's loop states mix per-device data (the
carries, depths, keys) with counters built from constants (``jnp.zeros``), which start
replicated and become varying after one step. The wrappers here make every state leaf varying
over the loop's *state axes*, going in and coming out, so the loops are well typed. A loop's
state axes are the manual axes its operands vary over (:func:`state_axes_of`, set for a loop
with :func:`loop_state_axes`): inside a ``shard_map`` over ``("data", "model")`` whose batch is
split over ``data`` and whose parameters are replicated, the loop's outputs vary over ``data``
only, as a ``lax.fori_loop``'s would, so ``out_specs=P("data")`` type-checks.

Outside ``shard_map`` there are no manual axes and every wrapper is the plain ``lax`` function.
A per-device loop is what we want there anyway: each device schedules its own shard.

The jaxpr re-interpreter :func:`eval_jaxpr` evaluates a traced step for the types its inputs
have at run time. Values typed with shardings on ``Explicit`` mesh axes are
:mod:`dyndepth._sharding`'s.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from . import _compat, _sharding

# The state axes of the loop being traced, with the manual axes they were chosen among; None:
# every manual axis (no loop set them, or a shard_map was entered since: dyndepth's own
# per-device shard_map, whose manual axes are the batch's).
_STATE_AXES: contextvars.ContextVar[tuple[tuple[str, ...], tuple[str, ...]] | None] = (
    contextvars.ContextVar("dyndepth_state_axes", default=None)
)


class StateAxes(tuple):
    """A loop's state axes (a tuple of manual axis names), with ``local``: those among them
    that a const's (or per-step input's) cotangent stays local over inside the loop
    (:func:`vary`): the axes its number of steps varies over, and those every carry leaf
    varies over."""

    local: tuple[str, ...]

    def __new__(cls, axes: Any, local: Any) -> StateAxes:
        self = super().__new__(cls, tuple(axes))
        self.local = tuple(a for a in self if a in set(local))
        return self


def state_axes() -> tuple[str, ...]:
    """The manual axes a loop's state varies over: those set by :func:`loop_state_axes` for the
    loop being traced, else every manual axis."""
    axes = _sharding.manual_axes()
    chosen = _STATE_AXES.get()
    if chosen is None or chosen[0] != axes:
        return axes
    return tuple(chosen[1])


def local_axes() -> tuple[str, ...]:
    """The manual axes over which a const's cotangent stays local inside the loop being traced
    (:class:`StateAxes`; the state axes when none were set)."""
    axes = _sharding.manual_axes()
    chosen = _STATE_AXES.get()
    if chosen is None or chosen[0] != axes:
        return axes
    return getattr(chosen[1], "local", tuple(chosen[1]))


def state_axes_of(leaves: Any) -> tuple[str, ...]:
    """The manual axes any of ``leaves`` (values or abstract values) varies over, in mesh order."""
    axes = _sharding.manual_axes()
    if not axes:
        return ()
    found = frozenset().union(*(_leaf_varying(x) for x in jax.tree_util.tree_leaves(leaves)))
    return tuple(a for a in axes if a in found)


def _leaf_varying(x: Any) -> frozenset:
    if isinstance(x, jax.core.AbstractValue | jax.ShapeDtypeStruct):
        return aval_varying(x)
    return varying(x)


@contextlib.contextmanager
def loop_state_axes(axes: tuple[str, ...]):
    """Trace a loop whose state varies over ``axes`` (see the module docstring)."""
    kept = axes if isinstance(axes, StateAxes) else tuple(axes)
    token = _STATE_AXES.set((_sharding.manual_axes(), kept))
    try:
        yield
    finally:
        _STATE_AXES.reset(token)


def varying(x: Any) -> frozenset:
    """The manual axes ``x`` varies over."""
    return aval_varying(jax.typeof(x))


def vary(tree: Any, axes: tuple[str, ...] | None = None) -> Any:
    """Mark every leaf of ``tree`` as varying over ``axes``; by default over the loop's
    :func:`local_axes`. A const or per-step input made so before a step's vjp keeps its
    cotangent local over them, summed once after the loop: over the axes the number of steps
    varies over, a sum inside the loop would be a collective the devices that stop early never
    join. Over an axis some carry leaf does not vary over it would make that leaf's new value
    vary unlike its cotangent (a weight split over ``model`` whose products the step sums over
    ``model`` leaves such a leaf replicated over ``model``)."""
    axes = local_axes() if axes is None else axes
    if not axes:
        return tree

    def one(x):
        missing = tuple(a for a in axes if a not in varying(x))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree_util.tree_map(one, tree)


def aval_varying(aval: Any) -> frozenset:
    """The manual axes an abstract value varies over (the attribute moved between releases)."""
    vma = getattr(aval, "vma", None)
    if vma is None:
        mat = getattr(aval, "manual_axis_type", None)
        vma = getattr(mat, "varying", ())
    return frozenset(vma)


def varying_example(example: Any) -> Any:
    """``example`` (a ``ShapeDtypeStruct``) as varying over the state axes, if any.

    The step functions are traced once on abstract examples. Inside ``shard_map`` the loop
    state is varying, so the examples must be too: otherwise the traced step pins casts (or
    inner ``cond``/``scan`` types) for replicated inputs that no longer fit at run time.
    """
    axes = state_axes()
    if not axes or example is None:
        return example
    mesh = jax.sharding.get_abstract_mesh()
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*[None] * example.ndim))
    weak = bool(getattr(example, "weak_type", False))  # a weak carry stays weak (lax's rule)
    try:  # the keyword moved between JAX releases
        mat = jax.sharding.ManualAxisType(varying=frozenset(axes))
        return jax.ShapeDtypeStruct(
            example.shape, example.dtype, sharding=sharding, manual_axis_type=mat, weak_type=weak
        )
    except (AttributeError, TypeError):
        try:
            return jax.ShapeDtypeStruct(
                example.shape, example.dtype, sharding=sharding, vma=frozenset(axes),
                weak_type=weak,
            )  # fmt: skip
        except TypeError:
            return example


_CALLS = frozenset(
    {"pjit", "jit", "closed_call", "core_call", "remat", "checkpoint"}
    | {"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin"}
)


def _call_jaxpr(params: dict) -> tuple[Any, list] | None:
    """The (open jaxpr, consts) a call-like equation evaluates."""
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = params.get(name)
        if inner is None:
            continue
        if hasattr(inner, "consts"):
            return inner.jaxpr, list(inner.consts)
        if hasattr(inner, "eqns"):
            return inner, []
    return None


def _in_varying(jaxpr: Any) -> list[frozenset]:
    return [aval_varying(v.aval) for v in jaxpr.invars]


def _fits(invals: list, jaxpr: Any) -> bool:
    return all(varying(x) == want for x, want in zip(invals, _in_varying(jaxpr), strict=False))


def _closed_fn(closed: Any) -> Callable:
    return lambda *a: eval_jaxpr(closed.jaxpr, list(closed.consts), *a)


def _retrace(eqn: Any, invals: list) -> list | None:
    """Re-run a call, ``cond``, ``while`` or ``scan`` equation through the ``lax`` function, so
    that its inner jaxprs are traced anew for the types its inputs have now. None when the
    equation is none of these, or a call whose traced input types still fit."""
    name, params = eqn.primitive.name, eqn.params
    if name in _CALLS:
        call = _call_jaxpr(params)
        if call is None or _fits(invals[-len(call[0].invars) :], call[0]):
            return None
        jaxpr, consts = call
        return eval_jaxpr(jaxpr, consts, *invals[-len(jaxpr.invars) :])
    # Control flow is always traced anew with every input varying over every axis any input
    # varies over: its inner jaxprs then hold no cast of an input, which ``vmap`` (turning a
    # batched ``cond`` into a select, which broadcasts the operands) would otherwise apply to
    # an already-varying value.
    if name in ("cond", "while", "scan"):
        invals = vary(list(invals), state_axes_of(invals))
    if name == "cond":
        branches = params["branches"]
        return switch(invals[0], [_closed_fn(br) for br in branches], *invals[1:])
    if name == "while":
        cn, bn = params["cond_nconsts"], params["body_nconsts"]
        cj, bj = params["cond_jaxpr"], params["body_jaxpr"]
        cc, bc, init = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
        return while_loop(
            lambda s: eval_jaxpr(cj.jaxpr, list(cj.consts), *cc, *s)[0],
            lambda s: eval_jaxpr(bj.jaxpr, list(bj.consts), *bc, *s),
            list(init),
        )
    if name == "scan":
        body = params["jaxpr"]
        nc, nk = params["num_consts"], params["num_carry"]
        consts, init, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]

        def step(c, x):
            out = eval_jaxpr(body.jaxpr, list(body.consts), *consts, *c, *x)
            return out[:nk], out[nk:]

        carry, ys = scan(
            step,
            list(init),
            list(xs),
            length=params["length"],
            reverse=params["reverse"],
            unroll=params.get("unroll", 1),
        )
        return list(carry) + list(ys)
    return None


def eval_jaxpr(jaxpr: Any, consts: list, *args: Any) -> list:
    """``jax.core.eval_jaxpr``, reconciling varying types that differ from the traced ones.

    Outside ``shard_map`` this is ``jax.core.eval_jaxpr``. Inside, an input may vary over more
    manual axes at run time than when the jaxpr was traced (a replicated parameter made varying
    so that its gradient stays per device, a key built from sharded data, or a step traced
    outside ``shard_map`` and run inside). Then a traced ``pvary`` of an already-varying value
    is skipped, a primitive whose inputs vary over different axes gets them all cast to the
    union (what ``jax.numpy`` does while tracing), and a ``cond``, ``while``, ``scan`` or call
    (``jit``, ``custom_jvp``/``custom_vjp`` function) whose traced input types no longer fit is
    traced anew (a call is inlined: the same computation, but a custom derivative rule of such
    a call no longer applies).
    """
    if not _sharding.manual_axes():
        return jax.core.eval_jaxpr(jaxpr, consts, *args)
    from jax.extend.core import Literal

    mesh = jax.sharding.get_abstract_mesh()

    env: dict = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "pvary" or (name == "pcast" and str(eqn.params.get("to")) == "varying"):
            outs = [vary(x, tuple(eqn.params["axes"])) for x in invals]
        elif (outs := _retrace(eqn, invals)) is None:
            if not any(_has_jaxpr(p) for p in eqn.params.values()):
                vmas = {varying(x) for x in invals}
                if len(vmas) > 1:
                    invals = [vary(x, tuple(sorted(frozenset().union(*vmas)))) for x in invals]
            # The traced equation's context, except when it was traced under another mesh (a
            # step traced outside shard_map and run inside it): entering it would record that
            # mesh, and lowering the primitive under it fails for varying values.
            with _compat.equation_context(eqn, mesh):
                outs = _compat.bind_equation(
                    eqn, invals, lambda p: _sharding.without_other_mesh(p, mesh),
                    lambda j, c, a: eval_jaxpr(j, c, *a),
                )  # fmt: skip
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _has_jaxpr(p: Any) -> bool:
    if isinstance(p, tuple | list):
        return any(_has_jaxpr(q) for q in p)
    return hasattr(p, "jaxpr") or hasattr(p, "eqns")


def varying_of(leaves: Any) -> list[frozenset]:
    """``varying`` of each leaf (empty sets outside ``shard_map``)."""
    if not _sharding.manual_axes():
        return [frozenset()] * len(leaves)
    return [varying(x) for x in leaves]


def unvary_to(cts: list, vmas: list[frozenset]) -> list:
    """Sum each cotangent over the manual axes it varies over but its primal (``vmas``) does not.

    That is the transpose of the implicit broadcast of a replicated value to varying data:
    the gradient of a parameter replicated over the devices is the sum of the per-device
    gradients.
    """
    if not _sharding.manual_axes():
        return cts

    def one(ct, vma):
        if ct is None or ct.dtype == jax.dtypes.float0:
            return ct
        extra = tuple(sorted(varying(ct) - vma))
        return lax.psum(ct, extra) if extra else ct

    return [one(ct, vma) for ct, vma in zip(cts, vmas, strict=True)]


def _cast(tree: Any, types: list[frozenset]) -> Any:
    """``tree`` with leaf ``i`` made varying over ``types[i]`` (which it must include)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef.unflatten(
        [vary(x, tuple(sorted(t))) for x, t in zip(leaves, types, strict=True)]
    )


def _traced(fn: Callable, *args: Any) -> tuple[Callable, list[frozenset]]:
    """``fn`` traced once on ``args`` (values, or abstract values such as a scan's per-step
    slice): a function evaluating the trace (no second trace of the Python code) and the manual
    axes each output leaf varies over."""
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    treedef = jax.tree_util.tree_structure(shape)

    def run(*a):
        flat = jax.tree_util.tree_leaves(a)
        # the inputs have the traced types: no reconciling needed (nor wanted: it would widen)
        return treedef.unflatten(jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *flat))

    return run, [aval_varying(v) for v in closed.out_avals]


def _settled(body: Callable, init: Any, *rest: Any) -> tuple[Any, Callable]:
    """``(init, body)`` for a loop whose state is typed as narrowly as it can be: each leaf
    of ``init`` made varying over the axes that ``body(init, *rest)``'s first outputs (one per
    leaf of ``init``) make it vary over, until none widens (a fixed point: at most one round
    per axis), and ``body`` traced once for those types, those outputs cast to them."""
    n = len(jax.tree_util.tree_leaves(init))
    for _ in range(len(_sharding.manual_axes()) + 1):
        run, out = _traced(body, init, *rest)
        have = [varying(x) for x in jax.tree_util.tree_leaves(init)]
        want = [h | o for h, o in zip(have, out[:n], strict=True)]
        if want == have:
            break
        init = _cast(init, want)

    def cast_body(*a):
        leaves, treedef = jax.tree_util.tree_flatten(run(*a))
        return treedef.unflatten(_cast(leaves[:n], have) + leaves[n:])

    return init, cast_body


def while_loop(cond: Callable, body: Callable, init: Any) -> Any:
    """``lax.while_loop``; inside ``shard_map``, each state leaf typed as varying over the axes
    the loop makes it vary over (and no more), so that the outputs are typed as narrowly as a
    ``lax.while_loop`` written for those types."""
    if not _sharding.manual_axes():
        return lax.while_loop(cond, body, init)
    init, body = _settled(body, init)
    return lax.while_loop(cond, body, init)


def scan(body: Callable, init: Any, xs: Any, **kwargs: Any) -> Any:
    """``lax.scan``, typed inside ``shard_map`` as :func:`while_loop` is."""
    if not _sharding.manual_axes():
        return lax.scan(body, init, xs, **kwargs)
    # One step's slice of ``xs``, abstract: a scan may have no steps.
    x_step = jax.tree_util.tree_map(lambda a: jax.typeof(a).update(shape=a.shape[1:]), xs)
    init, typed = _settled(body, init, x_step)
    return lax.scan(typed, init, xs, **kwargs)


def switch(index: Any, branches: list[Callable], *operands: Any) -> Any:
    """``lax.switch``; inside ``shard_map``, every branch's outputs typed as varying over the
    axes any branch's do."""
    if not _sharding.manual_axes():
        return lax.switch(index, branches, *operands)
    traced = [_traced(b, *operands) for b in branches]
    types = [frozenset().union(*t) for t in zip(*(out for _, out in traced), strict=True)]
    return lax.switch(
        index, [lambda *a, run=run: _cast(run(*a), types) for run, _ in traced], *operands
    )


def cond(pred: Any, true_fn: Callable, false_fn: Callable, *operands: Any) -> Any:
    """``lax.cond``, typed inside ``shard_map`` as :func:`switch` is."""
    if not _sharding.manual_axes():
        return lax.cond(pred, true_fn, false_fn, *operands)
    return switch(jnp.asarray(pred, jnp.int32), [false_fn, true_fn], *operands)
