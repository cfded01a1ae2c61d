"""The derivative of a loop's backward pass: what reverse over reverse, and forward over
reverse, differentiate.

The backward pass (``bwd_p``) reads the residuals its forward pass stored, in a layout the
kernels choose. Its derivative is not taken through them: ``bwd_p`` also carries the point the
loop was differentiated at (:class:`AtPoint`: the loop's operands), the forward pass's stored
outputs get symbolic-zero tangents, and the backward pass's tangent is the derivative of the
whole map ``V(operands, ct) = vjp(loop, operands)(ct)`` at that point, the forward pass
recomputed inside it. The residuals never leave the library (only ``lin_p`` and ``bwd_p`` read
them, and neither reads their tangents), so this is exact.

That tangent, ``dV(t, t_ct)``, is linear in the tangents of the operands and of the
cotangents, and is bound as its own primitive (``dbwd_p`` in :mod:`dyndepth._primitives`):

* evaluated (:func:`kernel`): forward mode through the loop's kernels, the forward pass
  recomputed and the backward pass run on it (cost: the depth, as ``jax.hessian`` costs);
* transposed or differentiated again (:func:`masked`): the same map written as the
  ``"masked"`` loop's (``lax.scan`` over ``max_steps``, every derivative of every order
  JAX's own), so that reverse over reverse is exact wherever the two differentiations sit,
  whatever ``jit``, ``lax.cond``, ``lax.scan``, ``lax.map`` or ``jax.checkpoint`` stands between
  them.

Both are functions of ``dbwd_p``'s flat operands (:class:`TangentOperands`) under its batch
levels (:class:`dyndepth._dispatch.Level`, innermost first): the levels the forward pass ran
batched over with aligned tangents run inside the kernels; any other level (added by a
``vmap`` after the differentiation, such as ``jax.jacrev``'s basis) is a ``jax.vmap`` around.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from . import _dispatch, _masked, _sharding
from ._derivative import Perturbed
from ._dispatch import Batch, Level
from ._leaves import merge, take
from ._operands import BwdOperands, LoopOperands, LoopOutputs, Residuals, Stored, n_stored
from ._residuals import ResidualPlan
from ._step import Loop


@dataclasses.dataclass(frozen=True)
class AtPoint:
    """``bwd_p``'s operands: the backward pass's (:class:`BwdOperands`), then the rest of the
    loop's operands (the stop predicate's consts, ``init`` and the depth): with them, the point
    the loop was differentiated at, which the derivative of the backward pass recomputes from."""

    bwd: BwdOperands
    cconsts: list
    init: list
    n: Any

    @staticmethod
    def split(flat: Sequence[Any], loop: Loop, pert: Perturbed,
              plan: ResidualPlan | None) -> AtPoint:  # fmt: skip
        flat = list(flat)
        nb = len(flat) - loop.n_cconsts - len(loop.carry_avals) - 1
        rest = flat[nb:]
        return AtPoint(BwdOperands.split(flat[:nb], loop, pert, plan), rest[: loop.n_cconsts],
                       rest[loop.n_cconsts : -1], rest[-1])  # fmt: skip

    def flat(self) -> list:
        return [*self.bwd.flat(), *self.cconsts, *self.init, self.n]

    def loop_operands(self) -> LoopOperands:
        b = self.bwd
        return LoopOperands(b.consts, self.cconsts, self.init, b.xs, self.n, b.kd)


@dataclasses.dataclass(frozen=True)
class TangentMask:
    """Which of the loop's consts, ``init`` and xs leaves have tangents in ``dbwd_p``."""

    consts: tuple[bool, ...]
    init: tuple[bool, ...]
    xs: tuple[bool, ...]


@dataclasses.dataclass(frozen=True)
class TangentOperands:
    """``dbwd_p``'s operands: ``bwd_p``'s (:class:`AtPoint`), the tangents of the masked
    consts, ``init`` and xs leaves, then those of the cotangents (``ct_carry``, ``ct_ys``)."""

    point: AtPoint
    t_consts: list
    t_init: list
    t_xs: list
    t_ct_carry: list
    t_ct_ys: list

    @staticmethod
    def split(flat: Sequence[Any], loop: Loop, pert: Perturbed, plan: ResidualPlan | None,
              mask: TangentMask) -> TangentOperands:  # fmt: skip
        counts = [sum(mask.consts), sum(mask.init), sum(mask.xs), sum(pert.carry), sum(pert.ys)]
        flat = list(flat)
        pos = len(flat) - sum(counts)
        point = AtPoint.split(flat[:pos], loop, pert, plan)
        groups = []
        for c in counts:
            groups.append(flat[pos : pos + c])
            pos += c
        return TangentOperands(point, *groups)

    def flat(self) -> list:
        return [*self.point.flat(), *self.t_consts, *self.t_init, *self.t_xs, *self.t_ct_carry,
                *self.t_ct_ys]  # fmt: skip

    def tangents(self) -> list:
        return self.flat()[len(self.point.flat()) :]


# ----------------------------------------------------------------------------- the backward pass


def backward(loop: Loop, batch: Batch, pert: Perturbed, plan: ResidualPlan | None,
             use_ext: bool, bwd: BwdOperands) -> list:  # fmt: skip
    """The backward pass over ``batch`` (levels whose flags cover :class:`BwdOperands`): the
    flat cotangents of the perturbed consts, ``init`` and xs leaves."""
    out = _dispatch.backward(loop, batch, pert, plan, use_ext, bwd)
    # A const sharded over an Explicit axis other than the batch's (a tensor-parallel weight)
    # was replicated into the per-device loops: its cotangent is typed back like it.
    n = sum(pert.consts)
    consts = take(bwd.consts, pert.consts)
    return [_sharding.typed_like(g, c) for g, c in zip(out[:n], consts, strict=True)] + out[n:]


def backward_levels(batch: Batch, loop: Loop, pert: Perturbed, plan) -> Batch:
    """``bwd_p``'s levels with their flags cut to the backward pass's operands."""

    def cut(lv):
        return tuple(AtPoint.split(lv.batched, loop, pert, plan).bwd.flat())

    return tuple(dataclasses.replace(lv, batched=cut(lv)) for lv in batch)


# ----------------------------------------------------------------------------- evaluated


def kernel(*ops, loop: Loop, batch: Batch, pert: Perturbed, plan: ResidualPlan | None,
           mask: TangentMask) -> list:  # fmt: skip
    """``dV(t, t_ct)`` by forward mode through the kernels (the forward pass recomputed): the
    flat tangents of the backward pass's outputs."""
    flags = [TangentOperands.split(lv.batched, loop, pert, plan, mask) for lv in batch]
    inner = 0
    while inner < len(batch) and _in_kernels(flags[inner], mask):
        inner += 1
    fn = functools.partial(_kernel_point, loop, pert, plan, mask, batch[:inner])
    for level in batch[inner:]:
        fn = _over_level(fn, level, loop, pert, plan, mask)
    return fn(*ops)


def _in_kernels(f: TangentOperands, mask: TangentMask) -> bool:
    """Whether a level runs inside the kernels: the forward pass ran batched over it and every
    tangent is batched like its primal (as jvp needs)."""
    x, b = f.point.loop_operands(), f.point.bwd
    primal = [*_masked_values(x, mask), b.ct_carry, b.ct_ys]
    tangent = [f.t_consts, f.t_init, f.t_xs, f.t_ct_carry, f.t_ct_ys]
    return any(x.flat()) and all(list(p) == list(t) for p, t in zip(primal, tangent, strict=True))


def _kernel_point(loop, pert, plan, mask, levels, *ops) -> list:
    """:func:`kernel` over ``levels``, all of which run inside the kernels."""
    d = TangentOperands.split(ops, loop, pert, plan, mask)
    x = d.point.loop_operands()
    flags = [TangentOperands.split(lv.batched, loop, pert, plan, mask) for lv in levels]
    fwd_levels = tuple(Level(lv.size, tuple(f.point.loop_operands().flat()))
                       for lv, f in zip(levels, flags, strict=True))  # fmt: skip
    nc, n_ext = len(loop.carry_avals), n_stored(plan)

    def bwd_flags(f, steps_b):  # (the recomputed residuals are batched as a forward pass's)
        b = f.point.bwd
        res = Residuals(steps_b, Stored([True] * nc, True, True, [False] * n_ext))
        return tuple(BwdOperands(b.consts, b.xs, b.kd, res, b.ct_carry, b.ct_ys).flat())

    bwd_levels = tuple(Level(lv.size, bwd_flags(f, sb), lv.reduce) for lv, f, sb in
                       zip(levels, flags, steps_flags(loop, fwd_levels), strict=True))  # fmt: skip
    # A batched forward pass stores no residual buffers: its backward pass recomputes.
    use_ext = plan is not None and not levels

    def V(kq, iq, xq, ct_c, ct_y):
        ops = _with(x, mask, kq, iq, xq)
        outs = _dispatch.forward(loop, fwd_levels, True, plan, pert, ops)
        outs = LoopOutputs.split(outs, loop, True, n_ext)
        res = Residuals(outs.steps, outs.stored)
        bwd = BwdOperands(ops.consts, ops.xs, ops.kd, res, ct_c, ct_y)
        return backward(loop, bwd_levels, pert, plan, use_ext, bwd)

    b = d.point.bwd
    primals = (*_masked_values(x, mask), b.ct_carry, b.ct_ys)
    tangents = (d.t_consts, d.t_init, d.t_xs, d.t_ct_carry, d.t_ct_ys)
    return list(jax.jvp(V, primals, tangents)[1])


def steps_flags(loop: Loop, batch: Batch) -> list[bool]:
    """Per level of a forward pass, whether its ``steps`` output is batched there."""
    return [
        i > 0 or bool(LoopOperands.split(level.batched, loop).n) or loop.cond_jaxpr is not None
        for i, level in enumerate(batch)
    ]


# ----------------------------------------------------------------------------- transposed


def masked(*ops, loop: Loop, batch: Batch, pert: Perturbed, plan: ResidualPlan | None,
           mask: TangentMask) -> list:  # fmt: skip
    """:func:`kernel`'s map as the ``"masked"`` loop's (plain ``lax``): what ``dbwd_p``'s
    transpose and derivatives take. The levels batched before the differentiation (the
    innermost, whose consts' cotangents are summed over them) run inside the vjp, so that
    JAX's batching sums them; the others are ``jax.vmap`` s around it."""
    inner = 0
    while inner < len(batch) and batch[inner].reduce:
        inner += 1
    fn = functools.partial(_masked_point, loop, pert, plan, mask, batch[:inner])
    for level in batch[inner:]:
        fn = _over_level(fn, level, loop, pert, plan, mask)
    return fn(*ops)


def _masked_point(loop, pert, plan, mask, levels, *ops) -> list:
    """:func:`masked` over ``levels``, all of which were batched before the differentiation."""
    d = TangentOperands.split(ops, loop, pert, plan, mask)
    x = d.point.loop_operands()
    flags = [TangentOperands.split(lv.batched, loop, pert, plan, mask).point for lv in levels]
    sizes = [lv.size for lv in levels]
    xf = [f.loop_operands() for f in flags]

    def everywhere(leaves, per_level):  # (per level, the leaves' flags)
        cols = _columns(per_level, len(leaves))
        return [_everywhere(a, fs, sizes) for a, fs in zip(leaves, cols, strict=True)]

    def all_rows(f):  # the vjp's init and xs leaves are batched at every level: their
        # cotangents are kept per row, as the backward pass returns them
        init = merge([True] * sum(pert.carry), take(f.init, pert.carry, False), pert.carry)
        xs = merge([True] * sum(pert.xs), take(f.xs, pert.xs, False), pert.xs)
        return _axes(dataclasses.replace(f, init=init, xs=xs).flat())

    in_axes = [all_rows(f) for f in xf]

    def V(kq, iq, xq, ct_c, ct_y):
        o = _with(x, mask, kq, iq, xq)

        def F(kp, ip, xp):
            full = LoopOperands(merge(kp, take(o.consts, pert.consts, False), pert.consts),
                                o.cconsts, merge(ip, take(o.init, pert.carry, False), pert.carry),
                                merge(xp, take(o.xs, pert.xs, False), pert.xs), o.n,
                                o.kd)  # fmt: skip
            fn = functools.partial(_masked_outputs, loop, pert)
            for axes, lv in zip(in_axes, levels, strict=True):
                fn = jax.vmap(fn, in_axes=axes, axis_size=lv.size)
            return fn(*full.flat())

        ip = everywhere(take(o.init, pert.carry), [take(f.init, pert.carry) for f in xf])
        xp = everywhere(take(o.xs, pert.xs), [take(f.xs, pert.xs) for f in xf])
        _, pull = jax.vjp(F, take(o.consts, pert.consts), ip, xp)
        cts = (everywhere(ct_c, [f.bwd.ct_carry for f in flags]),
               everywhere(ct_y, [f.bwd.ct_ys for f in flags]))  # fmt: skip
        g_k, g_i, g_x = pull(cts)
        return [*g_k, *g_i, *g_x]

    b = d.point.bwd
    primals = (*_masked_values(x, mask), b.ct_carry, b.ct_ys)
    tangents = (d.t_consts, d.t_init, d.t_xs, d.t_ct_carry, d.t_ct_ys)
    return list(jax.jvp(V, primals, tangents)[1])


def _masked_outputs(loop: Loop, pert: Perturbed, *flat):
    """One sample's ``"masked"`` loop: its perturbed carry and ys leaves."""
    o = LoopOperands.split(flat, loop)
    kd = None if loop.keys is None else o.kd
    carry, ys, _, _ = _masked._run(loop, o.consts, o.cconsts, o.init, o.xs, o.n, kd)
    return take(carry, pert.carry), take(ys, pert.ys)


# ----------------------------------------------------------------------------- helpers


def _over_level(fn: Callable, level: Level, loop, pert, plan, mask) -> Callable:
    """``fn`` (of ``dbwd_p``'s flat operands) mapped over ``level`` with ``jax.vmap``; a
    const's tangent summed over it where the backward pass sums the const's cotangent (a
    level batched before the differentiation that does not batch the const)."""
    f = TangentOperands.split(level.batched, loop, pert, plan, mask)
    summed = [level.reduce and not b for b in take(f.point.bwd.consts, pert.consts)]

    at = stored_at(len(level.batched), loop, pert, plan, mask)
    in_axes = _dispatch.level_axes(level.batched, at)

    def mapped(*ops):
        out = jax.vmap(fn, in_axes=in_axes, axis_size=level.size)(*ops)
        return [o.sum(0) if j < len(summed) and summed[j] else o for j, o in enumerate(out)]

    return mapped


def stored_at(n: int, loop, pert, plan, mask) -> list[int]:
    """The positions of the stored carries among ``dbwd_p``'s ``n`` flat operands."""
    return TangentOperands.split(list(range(n)), loop, pert, plan, mask).point.bwd.res.stored.buf


def _masked_values(x: LoopOperands, mask: TangentMask) -> tuple[list, list, list]:
    """The consts, ``init`` and xs leaves that have tangents."""
    return take(x.consts, mask.consts), take(x.init, mask.init), take(x.xs, mask.xs)


def _with(x: LoopOperands, mask: TangentMask, kq, iq, xq) -> LoopOperands:
    """``x`` with its masked consts, ``init`` and xs leaves replaced."""
    return dataclasses.replace(
        x,
        consts=merge(kq, take(x.consts, mask.consts, False), mask.consts),
        init=merge(iq, take(x.init, mask.init, False), mask.init),
        xs=merge(xq, take(x.xs, mask.xs, False), mask.xs),
    )


def _everywhere(a: Any, flags: Sequence[bool], sizes: Sequence[Any]) -> Any:
    """``a`` (batched at the levels its ``flags`` mark, innermost first) batched at every level:
    broadcast along the others."""
    pos = 0
    for b, size in zip(reversed(flags), reversed(sizes), strict=True):
        if not b:
            a = jnp.broadcast_to(jnp.expand_dims(a, pos), a.shape[:pos] + (size,) + a.shape[pos:])
        pos += 1
    return a


def _columns(per_level: Sequence[Sequence[bool]], n: int) -> list[list[bool]]:
    """Per leaf (of ``n``), its flag at each level, from each level's flags."""
    return [[flags[j] for flags in per_level] for j in range(n)]


def _axes(flags) -> list:
    return [0 if b else None for b in flags]
