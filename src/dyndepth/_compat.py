"""Every JAX name the loops use that JAX does not promise to keep, each with a fallback.

The rest of dyndepth uses JAX's public API (``jax``, ``jax.lax``, ``jax.extend``, and
``jax.interpreters`` for the primitives' rules). What is left is here, looked up when called
(not when dyndepth is imported), so that a JAX release that renames or removes a name makes its
fallback run instead of failing every loop. Each fallback and its cost (docs/limits.md,
"Private JAX names"):

- :func:`bound_axes` (does an enclosing ``vmap`` bind the axis a step's collective names?):
  JAX's public ``lax.axis_size`` first, then the private
  ``jax.extend.core.unsafe_get_axis_names_DO_NOT_USE``; without either, every name counts as
  bound.
- :func:`require_devices_when_lowered` (lower a loop on an ``Auto`` mesh knowing its devices):
  the private registry ``jax._src.dispatch.prim_requires_devices_during_lowering``; without it,
  nothing.
- :func:`lowering_devices` (the devices a loop is lowered for): the lowering context's
  ``module_context.axis_context.device_assignment``; without it, None.
- :func:`equation_context` (re-enter a traced equation's context when a step is evaluated
  inside ``shard_map``): the equation's ``ctx.cur_abstract_mesh`` and ``ctx.manager``; without
  them, a null context.
- :func:`bind_equation` (bind a traced equation again inside ``shard_map``):
  ``Primitive.get_bind_params``; without it, a call's jaxpr is evaluated inline.
- :func:`lowered_for_export` (is the program lowered for ``jax.export``?): the lowering
  context's ``module_context.lowering_parameters.for_export``; without it, False.
- :func:`trace_context` (the configuration a trace depends on, which JAX keys its own trace
  caches on): ``jax._src.config.trace_context``; without it, the public configuration options
  that change what a function traces to (:data:`TRACE_OPTIONS`).

``tests/core/test_compat.py`` hides each name and checks the loops against the references.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import jax
from jax import lax

# Where each private name is found: the attribute path below its owner. A test points an entry at
# a name that does not exist to run the fallback (tests/core/test_compat.py).
PRIVATE: dict[str, tuple[str, ...]] = {
    "axis_names": ("unsafe_get_axis_names_DO_NOT_USE",),  # of jax.extend.core
    "devices_registry": ("prim_requires_devices_during_lowering",),  # of jax._src.dispatch
    "device_assignment": ("module_context", "axis_context", "device_assignment"),  # of a ctx
    "eqn_mesh": ("ctx", "cur_abstract_mesh"),  # of a jaxpr equation
    "eqn_manager": ("ctx", "manager"),  # of a jaxpr equation
    "bind_params": ("get_bind_params",),  # of a primitive
    "for_export": ("module_context", "lowering_parameters", "for_export"),  # of a ctx
    "platforms": ("module_context", "platforms"),  # of a ctx
    "trace_context": ("trace_context",),  # of jax._src.config
}


def _private(owner: Any, name: str) -> Any:
    """``owner``'s private attribute ``name`` (see :data:`PRIVATE`), or None."""
    for attr in PRIVATE[name]:
        owner = getattr(owner, attr, None)
    return owner


def bound_axes(names: Iterable[Any]) -> set:
    """The axis names among ``names`` that an enclosing transformation (``vmap``, ``pmap``,
    ``shard_map``) binds where this is called.

    First JAX's public ``lax.axis_size``, which raises ``NameError`` for an unbound name; then
    the private list of bound names; without either, every name counts as bound (a step whose
    collective names an axis bound inside the step itself then runs in lockstep, as
    ``"masked"``: the same values, ``max_depth`` steps)."""
    names = set(names)
    axis_size = getattr(lax, "axis_size", None)
    if axis_size is not None:

        def bound(name):
            try:
                axis_size(name)
            except NameError:
                return False
            return True

        return {name for name in names if bound(name)}
    bound_now = _private(jax.extend.core, "axis_names")
    if bound_now is not None:
        return names & set(bound_now())
    return names


def require_devices_when_lowered(*prims: Any) -> bool:
    """Have ``jit`` lower programs containing ``prims`` with their device assignment, as it
    does for ``custom_partitioning`` (JAX's registry is private). Returns whether it could;
    without it, a batched loop on an ``Auto`` mesh under plain ``jit`` is not split per device
    (XLA partitions the loop like any other: the same values, but every device steps until the
    deepest sample of the whole batch is done)."""
    try:
        from jax._src import dispatch
    except ImportError:  # pragma: no cover - depends on JAX's internals
        return False
    registry = _private(dispatch, "devices_registry")
    if not isinstance(registry, set):
        return False
    registry.update(prims)
    return True


def lowering_devices(ctx: Any) -> Any:
    """The devices a lowering rule's module is lowered for, or None when unknown (a program
    lowered without a device assignment, or a JAX whose lowering context moved it)."""
    return _private(ctx, "device_assignment")


def equation_context(eqn: Any, mesh: Any) -> Any:
    """A context manager re-entering the context a jaxpr equation was traced in (its
    ``compute_on`` placement, XLA metadata, random-bits partitioning), when it was traced under
    ``mesh``; a null context otherwise, or when JAX keeps it elsewhere (then such annotations
    inside a step evaluated inside ``shard_map`` are dropped: the same values)."""
    manager = _private(eqn, "eqn_manager")
    if manager is None or _private(eqn, "eqn_mesh") != mesh:
        return contextlib.nullcontext()
    return manager


def bind_equation(eqn: Any, invals: list, rewrite: Callable[[dict], dict],
                  inline: Callable[[Any, list, list], list]) -> Any:  # fmt: skip
    """``eqn``'s primitive bound again to ``invals`` with its parameters (``rewrite`` applied).

    A call equation (``jit``, ``custom_jvp``/``custom_vjp`` function, ``shard_map``) holds its
    function as a jaxpr that binding takes as a Python function: JAX converts it with a private
    method. Without it, the call's jaxpr is evaluated inline (``inline(jaxpr, consts, args)``):
    the same values, but a custom derivative rule of that call no longer applies (the
    derivative of what it computes is taken instead)."""
    primitive = eqn.primitive
    convert = _private(primitive, "bind_params")
    if convert is not None:
        bind = convert(eqn.params)
        subfuns, bind = bind if isinstance(bind, tuple) else ((), bind)
        return primitive.bind(*subfuns, *invals, **rewrite(bind))
    # (``call_jaxpr``: a call whose jaxpr takes the equation's inputs as they are; a shard_map's
    # jaxpr takes one device's shards, and binding it raw fails loudly rather than inline it)
    inner = eqn.params.get("call_jaxpr")
    if inner is not None:
        jaxpr, consts = (
            (inner.jaxpr, list(inner.consts)) if hasattr(inner, "jaxpr") else (inner, [])
        )
        out = inline(jaxpr, consts, list(invals))
        return out if primitive.multiple_results else out[0]
    return primitive.bind(*invals, **rewrite(dict(eqn.params)))


def lowering_platform(ctx: Any) -> str | None:
    """The platform (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``) a lowering rule's module is
    lowered for; None when it is lowered for several at once (``jax.export``) or the lowering
    context does not say."""
    platforms = _private(ctx, "platforms")
    return platforms[0] if platforms is not None and len(platforms) == 1 else None


def lowered_for_export(ctx: Any) -> bool:
    """Whether the program being lowered in ``ctx`` is lowered for ``jax.export``; False when
    the lowering context does not say."""
    return bool(_private(ctx, "for_export"))


# The public options that change what a function traces to: the fallback of trace_context.
TRACE_OPTIONS = (
    "jax_enable_x64",
    "jax_numpy_dtype_promotion",
    "jax_numpy_rank_promotion",
    "jax_default_matmul_precision",
    "jax_default_prng_impl",
    "jax_threefry_partitionable",
    "jax_enable_checks",
    "jax_debug_nans",
    "jax_debug_infs",
    "jax_disable_jit",
)


def trace_context() -> tuple:
    """The configuration a function's trace depends on, hashable, as JAX keys its own trace
    caches (``jit``'s) on it: every option set by ``jax.config.update`` or by a context manager
    such as ``jax.default_matmul_precision`` or ``jax.numpy_rank_promotion``. Without JAX's own,
    the values of :data:`TRACE_OPTIONS`."""
    try:
        from jax._src import config
    except ImportError:  # pragma: no cover - depends on JAX's internals
        config = None
    read = _private(config, "trace_context")
    if callable(read):
        return read()
    return tuple(getattr(jax.config, name, None) for name in TRACE_OPTIONS)


def jaxprs_in_params(params: dict) -> list:
    """The core jaxprs among an equation's parameters (a ``ClosedJaxpr``'s unwrapped, tuples of
    them included): ``jax.extend.core.jaxprs_in_params`` where JAX has it (0.10 and later),
    else the same walk here."""
    public = getattr(jax.extend.core, "jaxprs_in_params", None)
    if public is not None:
        return list(public(params))
    found = []
    for value in params.values():
        for v in value if isinstance(value, tuple | list) else (value,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                found.append(v.jaxpr)
            elif isinstance(v, jax.extend.core.Jaxpr):
                found.append(v)
    return found
