"""Control flow that type-checks inside ``jax.shard_map``.

Inside ``shard_map`` (with its default ``check_vma=True``) every value records the manual mesh
axes it varies over, and ``lax.while_loop``/``scan``/``cond`` demand that a loop's state has the
same "varying" type going in and coming out. The engine's loop states mix per-device data (the
carries, depths, keys) with counters built from constants (``jnp.zeros``), which start
replicated and become varying after one step. The wrappers here make every state leaf varying
over all manual axes of the current mesh, going in and coming out, so the loops are well typed.

Outside ``shard_map`` there are no manual axes and every wrapper is the plain ``lax`` function.
A per-device loop is what we want there anyway: each device schedules its own shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import lax


def manual_axes() -> tuple[str, ...]:
    """The manual mesh axes of the enclosing ``shard_map`` (empty outside one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    return tuple(mesh.manual_axes)


def varying(x: Any) -> frozenset:
    """The manual axes ``x`` varies over (the attribute moved between JAX releases)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = aval.manual_axis_type.varying
    return frozenset(vma)


def vary(tree: Any, axes: tuple[str, ...] | None = None) -> Any:
    """Mark every leaf of ``tree`` as varying over ``axes`` (default: all manual axes)."""
    axes = manual_axes() if axes is None else axes
    if not axes:
        return tree

    def one(x):
        missing = tuple(a for a in axes if a not in varying(x))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree_util.tree_map(one, tree)


def varying_of(leaves: Any) -> list[frozenset]:
    """``varying`` of each leaf (empty sets outside ``shard_map``)."""
    if not manual_axes():
        return [frozenset()] * len(leaves)
    return [varying(x) for x in leaves]


def unvary_to(cts: list, vmas: list[frozenset]) -> list:
    """Sum each cotangent over the manual axes it varies over but its primal (``vmas``) does not.

    That is the transpose of the implicit broadcast of a replicated value to varying data:
    the gradient of a parameter replicated over the devices is the sum of the per-device
    gradients.
    """
    if not manual_axes():
        return cts

    def one(ct, vma):
        if ct is None or ct.dtype == jax.dtypes.float0:
            return ct
        extra = tuple(sorted(varying(ct) - vma))
        return lax.psum(ct, extra) if extra else ct

    return [one(ct, vma) for ct, vma in zip(cts, vmas, strict=True)]


def while_loop(cond: Callable, body: Callable, init: Any) -> Any:
    axes = manual_axes()
    if not axes:
        return lax.while_loop(cond, body, init)
    return lax.while_loop(cond, lambda s: vary(body(s), axes), vary(init, axes))


def scan(body: Callable, init: Any, xs: Any) -> Any:
    axes = manual_axes()
    if not axes:
        return lax.scan(body, init, xs)

    def wrapped(c, x):
        c, y = body(c, x)
        return vary(c, axes), vary(y, axes)

    return lax.scan(wrapped, vary(init, axes), xs)


def cond(pred: Any, true_fn: Callable, false_fn: Callable, *operands: Any) -> Any:
    axes = manual_axes()
    if not axes:
        return lax.cond(pred, true_fn, false_fn, *operands)
    return lax.cond(
        pred,
        lambda *a: vary(true_fn(*a), axes),
        lambda *a: vary(false_fn(*a), axes),
        *vary(operands, axes),
    )


def switch(index: Any, branches: list[Callable]) -> Any:
    axes = manual_axes()
    if not axes:
        return lax.switch(index, branches)
    return lax.switch(index, [lambda b=b: vary(b(), axes) for b in branches])
