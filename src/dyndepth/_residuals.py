"""Stored residuals: what one step's pullback needs, planned once and stored per step.

An unbatched loop's forward pass can store, per step, the leaves of the step's ``jax.vjp``
pullback, so that the backward pass applies each pullback without running the step again, as
``lax.scan`` does. Leaves that are inputs of the step are referenced, not stored: the consts
(a stacked operand's slice at the layer index included), the carry (stored anyway), the
step's ``x`` and its key. :data:`RESIDUAL_BUDGET` bounds what is stored per step.

Only the perturbed leaves (:class:`dyndepth._derivative.Perturbed`) are differentiated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from . import _budget, _sharding, _vma
from ._derivative import Perturbed
from ._leaves import merge, nbytes, take
from ._step import Loop, step_consts

# A step's stored residuals may take at most this many times the carry's bytes; beyond it the
# loop stores the carry alone and the backward pass recomputes the step.
RESIDUAL_BUDGET = 4


@dataclasses.dataclass(frozen=True, eq=False)
class ResidualPlan:
    """Where each leaf of one step's pullback comes from in the backward pass.

    ``sources[q]`` is ``("k", m)`` (const ``m``, sliced if stacked), ``("c", m)`` (carry leaf
    ``m``: the stored carry), ``("x", m)`` (leaf ``m`` of the step's ``x``), ``("key",)`` or
    ``("s", r)`` (stored residual ``r``, of aval ``stored[r]``)."""

    treedef: Any
    sources: tuple[tuple, ...]
    stored: tuple[jax.ShapeDtypeStruct, ...]


def step_vjp(loop: Loop, pert: Perturbed, consts: Sequence[Any], carry: Sequence[Any],
             x: Sequence[Any], key: Any):  # fmt: skip
    """One step and its pullback ``(ct_carry, ct_ys) -> (ct_consts, ct_carry, ct_x)`` over the
    perturbed leaves (``consts`` as :func:`step_consts` gives them). Returns
    ``((new_carry, y), pullback)``."""
    kp, cp, xp = pert.consts, pert.carry, pert.xs
    kn, cn, xn = take(consts, kp, False), take(carry, cp, False), take(x, xp, False)

    def f(kd, cd, xd):
        new_c, y = loop.inner(merge(kd, kn, kp), merge(cd, cn, cp), merge(xd, xn, xp), key)
        return (take(new_c, cp), take(y, pert.ys)), (new_c, y)

    # Inside shard_map, a vjp with respect to a replicated const would psum its cotangent over
    # the devices at every step, and the caller sums the loop's cotangents over them once more
    # at the end: varying consts (and xs) keep every step's cotangent per device (as in
    # rows_vjp). The carry keeps its loop-state type: its cotangent flows to the previous step.
    diff = (_vma.vary(take(consts, kp)), take(carry, cp), _vma.vary(take(x, xp)))
    _, pullback, aux = jax.vjp(f, *diff, has_aux=True)
    return aux, pullback


def residual_plan(loop: Loop, pert: Perturbed, consts, xs, kd) -> ResidualPlan | None:
    """Plan the stored-residual path of an unbatched loop, or ``None`` where it does not apply
    (checkpoint thinning, inside ``shard_map``, or residuals over the budget)."""
    if _budget.fitted(loop, ()).thinning or _sharding.manual_axes() or not pert.any:
        return None
    found = {}

    def trace(consts, carry, x, kd):
        key = loop.key_at(kd, jnp.zeros((), jnp.int32))
        cs = step_consts(loop.stacked, consts, x)
        _, pullback = step_vjp(loop, pert, cs, carry, x, key)
        leaves, treedef = jax.tree_util.tree_flatten(pullback)
        named = [("k", m, c) for m, c in enumerate(cs)] + [("c", m, c) for m, c in enumerate(carry)]
        named += [("x", m, c) for m, c in enumerate(x)]
        sources, stored = [], []
        for leaf in leaves:
            hit = next((n[:2] for n in named if n[2] is leaf), None)
            if hit is None and key is not None and leaf is key:
                hit = ("key",)
            if hit is None:
                hit = ("s", len(stored))
                stored.append(leaf)
            sources.append(hit)
        found.update(treedef=treedef, sources=tuple(sources))
        return stored

    # Traced with the real values (their types, shardings included, reach the stored avals).
    stored = jax.eval_shape(
        lambda consts, carry, xs, kd: trace(consts, carry, [a[0] for a in xs], kd),
        list(consts), list(loop.carry_avals), list(xs), kd,
    )  # fmt: skip
    stored = tuple(stored)
    if nbytes(stored) > RESIDUAL_BUDGET * max(nbytes(loop.carry_avals), 1):
        return None
    return ResidualPlan(treedef=found["treedef"], sources=found["sources"], stored=stored)


def stored_leaves(plan: ResidualPlan, pullback: Any) -> list:
    """The leaves of ``pullback`` that ``plan`` stores."""
    leaves = jax.tree_util.tree_leaves(pullback)
    return [lf for lf, src in zip(leaves, plan.sources, strict=True) if src[0] == "s"]


def pullback_of(plan: ResidualPlan, cs, carry, stored, x, key):
    """One step's pullback, rebuilt from its referenced and stored residuals."""
    leaves = []
    for src in plan.sources:
        kind = src[0]
        if kind == "k":
            leaves.append(cs[src[1]])
        elif kind == "c":
            leaves.append(carry[src[1]])
        elif kind == "x":
            leaves.append(x[src[1]])
        elif kind == "key":
            leaves.append(key)
        else:
            leaves.append(stored[src[1]])
    return jax.tree_util.tree_unflatten(plan.treedef, leaves)
