"""The loop primitives and their transformation rules.

Four primitives, each carrying the loop (:class:`dyndepth._step.Loop`) and its batch
structure (:class:`dyndepth._dispatch.Level`, what ``vmap`` added) as parameters:

* ``loop_p``: the forward loop; with ``store`` it also returns what the backward pass needs
  (the carry before every step, checkpoints, stored residuals).
* ``lin_p``: the tangent of the loop, linear in the tangents of the consts, ``init`` and ``xs``
  (the forward sweep of the jvp'd step: forward mode); its transpose is ``bwd_p``.
* ``bwd_p``: the reverse sweep; it also carries the point the loop was differentiated at.
* ``dbwd_p``: the tangent of ``bwd_p`` (second order), linear in the tangents of that point
  and of the cotangents (:mod:`dyndepth._second_order`).

Every derivative of these is again one of them or plain ``lax``: the tangent of a forward pass
that stores is ``lin_p`` (what it stores gets a symbolic-zero tangent, which nothing reads),
``dbwd_p`` is transposed and differentiated as the ``"masked"`` loop's same map. So every order
of differentiation works whatever stands between two of them (``jit``, ``lax.cond``,
``lax.scan``, ``jax.checkpoint``), with no need to know whether an outer reverse pass exists.

Their operands and outputs travel as flat lists in the order :mod:`dyndepth._operands` names;
every rule reads them (and a batch level's flags) through those layouts. Each primitive's rules
are registered in one block at the end of its section.

A primitive keeps the order in which transformations were applied, which a ``custom_vjp``
loses. Under ``grad(vmap(f))`` the batching rule runs first and the JVP rule then sees the
batched loop: its backward pass sums a shared parameter's gradient over the batch inside the
loop (no per-sample copy). Under ``vmap(grad(f))`` the JVP rule sees the unbatched loop, and
``bwd_p``'s batching rule keeps every sample's gradient apart, as that composition means.

Only what is perturbed is differentiated (:func:`dyndepth._derivative.perturbation`): consts nothing
differentiates stay constants of the backward pass, and a carry leaf no tangent reaches has no
tangent.

Every rule only rebinds with new parameters; the kernels run when a primitive is lowered (or
evaluated eagerly), chosen in :mod:`dyndepth._dispatch`. A kernel is traced once per
parameters and input types; the abstract evaluation reads its output types.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive, jaxpr_as_fun
from jax.interpreters import ad, batching, mlir

from . import _batched, _compat, _cost, _dispatch, _per_device, _second_order, _sharding, _vma
from ._derivative import Perturbed, const_order, jvp_loop, perturbation
from ._dispatch import Batch, Level
from ._keys import mixed_draws
from ._leaves import merge, take
from ._operands import (
    BwdOperands,
    Cotangents,
    LinOperands,
    LoopOperands,
    LoopOutputs,
    Residuals,
    Stored,
    Tangents,
    n_stored,
)
from ._residuals import residual_plan
from ._second_order import AtPoint, TangentMask, TangentOperands, steps_flags
from ._step import Loop
from ._store import ROW_AXIS

loop_p = Primitive("dyndepth_loop")
lin_p = Primitive("dyndepth_loop_tangent")
bwd_p = Primitive("dyndepth_loop_transpose")
dbwd_p = Primitive("dyndepth_loop_transpose_tangent")
for _p in (loop_p, lin_p, bwd_p, dbwd_p):
    _p.multiple_results = True


# ----------------------------------------------------------------------------- kernels


def _forward_kernel(*ops, loop, batch, store, plan, pert):
    return _dispatch.forward(loop, batch, store, plan, pert, LoopOperands.split(ops, loop))


def _backward_kernel(*ops, loop, batch, pert, plan, use_ext):
    bwd = AtPoint.split(ops, loop, pert, plan).bwd
    levels = _second_order.backward_levels(batch, loop, pert, plan)
    return _second_order.backward(loop, levels, pert, plan, use_ext, bwd)


def _tangent_kernel(*ops, loop, batch, pert, plan, keep, use_ext):
    """The tangents: the jvp'd loop (:func:`dyndepth._derivative.jvp_loop`) run from ``init``."""
    del use_ext
    lin = LinOperands.split(ops, loop, pert, plan, keep)
    aug = jvp_loop(loop, pert)
    aug_batch = tuple(
        dataclasses.replace(lv, batched=tuple(_jvp_operands(
            loop, pert, LinOperands.split(lv.batched, loop, pert, plan, keep)).flat()))
        for lv in batch
    )  # fmt: skip
    outs = loop_p.bind(*_jvp_operands(loop, pert, lin).flat(), loop=aug, batch=aug_batch,
                       store=False, plan=None, pert=None)  # fmt: skip
    outs = LoopOutputs.split(outs, aug, store=False)
    # The jvp'd loop's carry and ys: the loop's, then their tangents.
    return outs.carry[len(loop.carry_avals) :] + outs.ys[len(loop.y_avals) :]


def _jvp_operands(loop: Loop, pert: Perturbed, lin: LinOperands) -> LoopOperands:
    """The operands (or their batching flags) of the jvp'd loop, from ``lin_p``'s: the consts
    and their tangents in :func:`dyndepth._derivative.const_order`, the carry and xs leaves followed
    by their tangents."""
    p = lin.primal
    both = list(p.consts) + list(lin.t_consts)
    consts = [both[j] for j in const_order(loop, pert)]
    return LoopOperands(consts, p.cconsts, [*p.init, *lin.t_init], [*p.xs, *lin.t_xs], p.n, p.kd)


_KERNELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_KERNEL_FNS = {"loop": _forward_kernel, "bwd": _backward_kernel, "dbwd": _second_order.kernel}


def _kernel_jaxpr(kind: str, params: dict, avals: tuple, partitioned: bool = False):
    """The kernel of ``kind`` traced for these parameters and input types (cached); with
    ``partitioned``, its batched loops take part in XLA's partitioning (one per device). Its
    slot counts follow the time model of the platform being lowered for."""
    table = _KERNELS.setdefault(params["loop"], {})
    key = (kind, tuple(sorted((k, v) for k, v in params.items() if k != "loop")), avals,
           jax.sharding.get_abstract_mesh(), partitioned, _cost.current_platform())  # fmt: skip
    hit = table.get(key)
    if hit is None:
        axes = _state_axes(kind, params, avals)
        with _per_device.partitioning(partitioned), _vma.loop_state_axes(axes):
            hit = jax.make_jaxpr(functools.partial(_KERNEL_FNS[kind], **params))(*avals)
        table[key] = hit
    return hit


def _state_axes(kind: str, params: dict, avals: tuple) -> _vma.StateAxes:
    """The manual axes a kernel's loop state varies over: those of its operands but the consts,
    and of the step's carry, xs and key and outputs and the stop predicate's inputs, as
    traced. A const's axes count only
    through the step's outputs: a weight split over ``model`` whose products the step sums over
    ``model`` (``lax.psum``) leaves the state replicated over ``model``.

    With them (:attr:`dyndepth._vma.StateAxes.local`), the axes a const's cotangent is kept
    local over inside the loop: those the number of steps varies over (the depth's, with a
    stop predicate its consts' and the carry's; in a backward pass the forward pass's
    ``steps``), and those every carry leaf varies over (the batch's: the weights' gradient is
    then summed over them once, after the loop). Not an axis some carry leaf is replicated over
    (a ``model`` axis its step sums over): the const's contribution to that leaf would vary
    over it unlike the leaf's cotangent, and casting the cotangent would count it once per
    device of that axis."""
    loop = params["loop"]
    step_out = loop.step_jaxpr.out_avals[: len(loop.carry_avals)]  # (the new carry)
    if kind == "dbwd":  # (the forward and backward passes, recomputed: as the backward pass's)
        split = TangentOperands.split(avals, loop, params["pert"], params["plan"], params["mask"])
        return _state_axes("bwd", params, tuple(split.point.flat()))
    if kind == "bwd":
        ops = AtPoint.split(avals, loop, params["pert"], params["plan"]).bwd
        uneven, leaves = [ops.res.steps], [[b] for b in ops.res.stored.buf]
    else:
        ops = LoopOperands.split(avals, loop)
        uneven = [ops.n]
        if loop.cond_jaxpr is not None:
            uneven += [ops.cconsts, ops.init, loop.cond_jaxpr.in_avals, step_out]
        leaves = [[i, o] for i, o in zip(ops.init, step_out, strict=True)]
    # The step's inputs after its consts: its carry, x and key.
    traced = [loop.step_jaxpr.in_avals[loop.n_consts :], loop.step_jaxpr.out_avals]
    if loop.cond_jaxpr is not None:
        traced.append(loop.cond_jaxpr.in_avals)
    axes = _vma.state_axes_of([dataclasses.replace(ops, consts=[]).flat(), traced])
    local = set(_vma.state_axes_of(uneven))
    if leaves:
        local |= set.intersection(*(set(_vma.state_axes_of(leaf)) for leaf in leaves))
    return _vma.StateAxes(axes, local)


def _effects(loop: Loop) -> bool:
    """Whether the step or stop predicate has side effects (host callbacks)."""
    jaxprs = [loop.step_jaxpr] + ([loop.cond_jaxpr] if loop.cond_jaxpr is not None else [])
    return any(j.effects for j in jaxprs)


def _register(prim: Primitive, kind: str, partitions: bool = True):
    """Abstract evaluation, lowering and eager evaluation through the kernel of ``kind``; with
    ``partitions``, its batched loops take part in XLA's partitioning (one per device)."""

    def abstract_eval(*avals, **params):
        closed = _kernel_jaxpr(kind, params, tuple(avals))
        return closed.out_avals, closed.effects

    def lower(ctx, *ops, **params):
        # Only the outermost dyndepth loop of a program is partitioned per device: a loop
        # nested in another's step already runs on that loop's per-device rows.
        # A step with side effects (jax.debug.print, callbacks) runs unpartitioned: XLA's
        # partitioner cannot carry a host callback into the per-device calls (the process
        # crashed); the batch is then gathered, as for any unpartitioned operation.
        partitioned = (partitions and _per_device.lowering_for_devices(ctx)
                       and not _effects(params["loop"]))  # fmt: skip
        with _per_device.nested_lowering(), _cost.lowering_for(_compat.lowering_platform(ctx)):
            closed = _kernel_jaxpr(kind, params, tuple(ctx.avals_in), partitioned)
            return mlir.lower_fun(jaxpr_as_fun(closed), multiple_results=True)(ctx, *ops)

    prim.def_effectful_abstract_eval(abstract_eval)
    prim.def_impl(_eager(prim, _KERNEL_FNS[kind]))
    mlir.register_lowering(prim, lower)


def _eager(prim: Primitive, kernel):
    """Eager evaluation through a jitted bind, cached on the parameters, so that calling the
    same loop again does not compile it again (under ``jax.disable_jit``, the kernel itself)."""

    @functools.lru_cache(maxsize=256)
    def jitted(items):
        params = dict(items)
        return jax.jit(lambda *ops: prim.bind(*ops, **params))

    def impl(*ops, **params):
        if jax.config.jax_disable_jit:
            return kernel(*ops, **params)
        return jitted(tuple(sorted(params.items())))(*ops)

    return impl


# ----------------------------------------------------------------------------- helpers


def _move(x, d, to=0):
    return x if d is None or d == to else jnp.moveaxis(x, d, to)


def _moved(args, dims, stored_at) -> list:
    """The batched operands at their axis of the new level: the first, but the stored carries'
    (at positions ``stored_at``) after their slots (:func:`dyndepth._dispatch.level_axes`)."""
    to = _dispatch.level_axes([d is not None for d in dims], stored_at)
    return [_move(x, d, t) for x, d, t in zip(args, dims, to, strict=True)]


def _size(args, dims):
    return next(jnp.shape(x)[d] for x, d in zip(args, dims, strict=True) if d is not None)


# ----------------------------------------------------------------------------- loop_p rules


def _one_at_a_time(prim, args, dims, params) -> list:
    """``prim`` over the batch one sample at a time (``lax.map``), each sample's loop
    unbatched: for a key implementation whose draws a ``vmap`` over rows would mix between
    samples (:attr:`dyndepth._keys.KeySchedule.batches_per_sample`). The outputs are batched
    at axis 0."""
    pos = [j for j, d in enumerate(dims) if d is not None]

    def one(sample):
        ops = list(args)
        for j, x in zip(pos, sample, strict=True):
            ops[j] = x
        return prim.bind(*ops, **params)

    return list(jax.lax.map(one, [_move(args[j], dims[j]) for j in pos]))


_PER_SAMPLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _per_sample_draws(loop: Loop) -> bool:
    """Whether a ``vmap`` of the step over rows keeps each row's draws its own: not when the
    loop's key, or a key the step draws from, batches from one key (``rbg``)."""
    hit = _PER_SAMPLE.get(loop)
    if hit is None:
        jaxprs = [loop.step_jaxpr] + ([loop.cond_jaxpr] if loop.cond_jaxpr is not None else [])
        hit = (loop.keys is None or loop.keys.batches_per_sample) and not any(
            mixed_draws(j.jaxpr)[0] for j in jaxprs
        )
        _PER_SAMPLE[loop] = hit
    return hit


def _loop_batch(args, dims, *, loop, batch, store, plan, pert):
    params = dict(loop=loop, batch=batch, store=store, plan=plan, pert=pert)
    if not _per_sample_draws(loop):
        flat = _one_at_a_time(loop_p, args, dims, params)
        outs = LoopOutputs.split(flat, loop, store, n_stored(plan))
        merged = _batched.merge_stats(outs.stats, _per_device.Across())
        out_dims = dataclasses.replace(LoopOutputs.split([0] * len(flat), loop, store,
                                                         n_stored(plan)), stats=None)  # fmt: skip
        return dataclasses.replace(outs, stats=merged).flat(), out_dims.flat()
    flags = tuple(d is not None for d in dims)
    level = Level(_size(args, dims), flags)
    args = [_move(x, d) for x, d in zip(args, dims, strict=True)]  # (no stored carries)
    params["batch"] = batch + (level,)
    outs = loop_p.bind(*args, **params)
    nc, ny = len(loop.carry_avals), len(loop.y_avals)
    steps_b = steps_flags(loop, params["batch"])[-1]
    # Everything gains the new axis (the stored carries after their slots) but a shared step
    # count, the statistics (summed over the rows) and the stored-residual buffers (unfilled
    # under a batch).
    stored = Stored([ROW_AXIS] * nc, 0, 0, [None] * n_stored(plan)) if store else None
    out_dims = LoopOutputs([0] * nc, [0] * ny, 0 if steps_b else None, None, stored)
    return outs, out_dims.flat()


def _zeros_for(outs):
    return [ad.Zero(jax.typeof(o).to_tangent_aval()) for o in outs]


def _loop_jvp(primals, tangents, *, loop, batch, store, plan, pert):
    params = dict(loop=loop, batch=batch, store=store, plan=plan, pert=pert)
    nonzero = LoopOperands.split([type(t) is not ad.Zero for t in tangents], loop)
    perturbed = perturbation(loop, nonzero.consts, nonzero.init, nonzero.xs)
    if store:
        return _stored_jvp(primals, tangents, perturbed, params)
    if not perturbed.any:
        outs = loop_p.bind(*primals, **params)
        return outs, _zeros_for(outs)
    base, t_out = _linearized(loop, batch, primals, tangents, perturbed)
    return base.flat(), t_out.flat()


def _linearized(loop: Loop, batch: Batch, primals, tangents, pert: Perturbed,
                stored: LoopOutputs | None = None,
                plan=None) -> tuple[LoopOutputs, LoopOutputs]:  # fmt: skip
    """The loop's outputs (what it stores left out) and their tangents: a forward pass that
    stores what the backward pass needs (``stored``, with its ``plan``, where one is bound
    already) and ``lin_p`` on it, whose transpose is the backward pass. ``"while"`` stores
    nothing: its ``lin_p`` runs the jvp'd loop from ``init`` and has no transpose."""
    keep = loop.strategy != "while"
    ops = LoopOperands.split(primals, loop)
    if stored is None:
        if keep and not batch:
            kd = None if loop.keys is None else ops.kd
            plan = _plan_for(loop, pert, ops.consts, ops.xs, kd)
        outs = loop_p.bind(*primals, loop=loop, batch=batch, store=keep, plan=plan, pert=pert)
        stored = LoopOutputs.split(outs, loop, keep, n_stored(plan))
    t = LoopOperands.split([ad.instantiate_zeros(t) for t in tangents], loop)
    res = Residuals(stored.steps, stored.stored) if keep else None
    lin = LinOperands(ops, res, take(t.consts, pert.consts), take(t.init, pert.carry),
                      take(t.xs, pert.xs))  # fmt: skip
    lin_batch = tuple(
        dataclasses.replace(lv, batched=_lin_flags(loop, pert, plan, keep, lv.batched, sb))
        for lv, sb in zip(batch, steps_flags(loop, batch), strict=True)
    )
    t_out = lin_p.bind(*lin.flat(), loop=loop, batch=lin_batch, pert=pert, plan=plan, keep=keep,
                       use_ext=True)  # fmt: skip
    base = dataclasses.replace(stored, stored=None)
    return base, _tangents_out(loop, pert, base, Tangents.split(t_out, pert))


def _stored_jvp(primals, tangents, pert: Perturbed, params: dict):
    """The jvp of a forward pass that stores (a differentiated loop's, differentiated again).

    Its stored outputs get symbolic-zero tangents: only ``lin_p`` and ``bwd_p`` read them, and
    neither reads their tangents (``lin_p`` runs the jvp'd loop from ``init``; the derivative of
    ``bwd_p`` recomputes from the loop's operands, :mod:`dyndepth._second_order`). The carry's
    and ys' tangents are the first derivative's, ``lin_p``, whose transpose is a backward pass:
    reverse mode over this costs what the depth costs."""
    loop, batch, plan = params["loop"], params["batch"], params["plan"]
    outs = loop_p.bind(*primals, **params)
    zeros = LoopOutputs.split(_zeros_for(outs), loop, True, n_stored(plan))
    if not pert.any:
        return outs, zeros.flat()
    # The bound pass stores what these tangents' backward pass needs when it was planned for
    # them; otherwise a pass planned for them.
    same = pert == params["pert"]
    stored = LoopOutputs.split(outs, loop, True, n_stored(plan)) if same else None
    _, t_out = _linearized(loop, batch, primals, tangents, pert, stored, plan if same else None)
    return outs, dataclasses.replace(t_out, stored=zeros.stored).flat()


def _tangents_out(loop: Loop, pert: Perturbed, base: LoopOutputs, t: Tangents) -> LoopOutputs:
    """The tangents of the loop's outputs: ``t`` for the perturbed carry and ys leaves,
    symbolic zeros elsewhere."""
    zeros = LoopOutputs.split(_zeros_for(base.flat()), loop, False)
    return LoopOutputs(merge(t.carry, take(zeros.carry, pert.carry, False), pert.carry),
                       merge(t.ys, take(zeros.ys, pert.ys, False), pert.ys),
                       zeros.steps, zeros.stats)  # fmt: skip


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _plan_for(loop: Loop, pert: Perturbed, consts, xs, kd):
    """:func:`dyndepth._residuals.residual_plan`, once per loop, perturbation and operand
    types: the plan is a parameter of the primitives, so a new one per call would compile an
    un-jitted loop's forward and backward passes again at every call."""
    types = tuple((jax.typeof(a), getattr(jax.typeof(a), "sharding", None))
                  for a in [*consts, *xs] + ([] if kd is None else [kd]))  # fmt: skip
    key = (pert, types, kd is None, _sharding.manual_axes(), jax.sharding.get_abstract_mesh())
    table = _PLANS.setdefault(loop, {})
    if key not in table:
        table[key] = residual_plan(loop, pert, consts, xs, kd)
    return table[key]


def _lin_flags(loop: Loop, pert: Perturbed, plan, keep: bool, loop_flags, steps_b: bool) -> tuple:
    """A level's batching flags for ``lin_p``'s operands, from ``loop_p``'s: the residuals
    are batched like the forward pass's outputs (the stored-residual buffers never)."""
    f = LoopOperands.split(loop_flags, loop)
    nc = len(loop.carry_avals)
    res = (
        Residuals(steps_b, Stored([True] * nc, True, True, [False] * n_stored(plan)))
        if keep
        else None
    )
    lin = LinOperands(f, res, take(f.consts, pert.consts), take(f.init, pert.carry),
                      take(f.xs, pert.xs))  # fmt: skip
    return tuple(lin.flat())


_register(loop_p, "loop")
batching.primitive_batchers[loop_p] = _loop_batch
ad.primitive_jvps[loop_p] = _loop_jvp


# ----------------------------------------------------------------------------- lin_p rules


def _lin_abstract_eval(*avals, loop, batch, pert, plan, keep, use_ext):
    """The tangents' types: those of the loop's carry and ys outputs (perturbed leaves)."""

    def primal(flat):
        return tuple(LinOperands.split(flat, loop, pert, plan, keep).primal.flat())

    fwd_batch = tuple(dataclasses.replace(lv, batched=primal(lv.batched)) for lv in batch)
    # The forward pass that made the residuals, as bound (its kernel is traced already).
    params = dict(loop=loop, batch=fwd_batch, store=keep, plan=plan, pert=pert if keep else None)
    closed = _kernel_jaxpr("loop", params, primal(avals))
    outs = LoopOutputs.split(closed.out_avals, loop, keep, n_stored(plan))
    return Tangents(take(outs.carry, pert.carry), take(outs.ys, pert.ys)).flat()


def _lin_impl(*ops, **params):
    return _tangent_kernel(*ops, **params)


def _lin_batch(args, dims, *, loop, batch, pert, plan, keep, use_ext):
    if not _per_sample_draws(loop):
        params = dict(loop=loop, batch=batch, pert=pert, plan=plan, keep=keep, use_ext=use_ext)
        outs = _one_at_a_time(lin_p, args, dims, params)
        return outs, [0] * len(outs)
    flags = tuple(d is not None for d in dims)
    if keep and LinOperands.split(flags, loop, pert, plan, keep).res.stored.stride:
        use_ext = False  # the forward pass ran batched here: its residual buffers are empty
    level = Level(_size(args, dims), flags)
    at = LinOperands.split(list(range(len(args))), loop, pert, plan, keep).res
    args = _moved(args, dims, set() if at is None else set(at.stored.buf))
    outs = lin_p.bind(*args, loop=loop, batch=batch + (level,), pert=pert, plan=plan,
                      keep=keep, use_ext=use_ext)  # fmt: skip
    return outs, [0] * len(outs)


def _lin_jvp(primals, tangents, **params):
    # The tangent loop is itself a loop primitive: its derivatives go through loop_p's rules.
    tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
    return jax.jvp(lambda *ops: _tangent_kernel(*ops, **params), tuple(primals), tangents)


def _lin_transpose(cts, *ops, loop, batch, pert, plan, keep, use_ext):
    if not keep:
        raise TypeError(_REVERSE_MSG)
    lin = LinOperands.split(ops, loop, pert, plan, keep)
    cts = Tangents.split([ad.instantiate_zeros(c) for c in cts], pert)
    p = lin.primal
    bwd = AtPoint(BwdOperands(p.consts, p.xs, p.kd, lin.res, cts.carry, cts.ys), p.cconsts,
                  p.init, p.n)  # fmt: skip
    bwd_batch = tuple(
        Level(lv.size, _bwd_flags(loop, pert, plan, lv.batched), reduce=True) for lv in batch
    )
    out = bwd_p.bind(*bwd.flat(), loop=loop, batch=bwd_batch, pert=pert, plan=plan,
                     use_ext=use_ext)  # fmt: skip
    g = Cotangents.split(out, pert)
    # The tangents of init and xs are shaped like their primals: sum the cotangents over the
    # levels that did not batch them (the transpose of the broadcast to the rows).
    flags = [LinOperands.split(lv.batched, loop, pert, plan, keep) for lv in batch]
    g_i = [_sum_unbatched(c, [f.t_init[j] for f in flags], batch) for j, c in enumerate(g.init)]
    g_x = [_sum_unbatched(c, [f.t_xs[j] for f in flags], batch) for j, c in enumerate(g.xs)]
    blank = LinOperands.split([None] * len(ops), loop, pert, plan, keep)
    grads = dataclasses.replace(blank, t_consts=g.consts, t_init=g_i, t_xs=g_x).flat()
    out = [c if ad.is_undefined_primal(o) else None for o, c in zip(ops, grads, strict=True)]
    # Inside shard_map, the cotangent of a value replicated over a mesh axis is the sum of the
    # per-device cotangents, which the loops keep local (varying): one psum, after the loops.
    vmas = [_vma.aval_varying(o.aval) if ad.is_undefined_primal(o) else frozenset() for o in ops]
    return _vma.unvary_to(out, vmas)


def _sum_unbatched(g, batched_per_level, batch: Batch):
    """Sum ``g`` (batched at every level) over the levels where the primal is not batched."""
    axes = tuple(len(batch) - 1 - i for i, b in enumerate(batched_per_level) if not b)
    return g.sum(axes) if axes else g


def _bwd_flags(loop: Loop, pert: Perturbed, plan, lin_flags) -> tuple:
    """A level's batching flags for ``bwd_p``'s operands, from ``lin_p``'s: the cotangents are
    batched at every level."""
    f = LinOperands.split(lin_flags, loop, pert, plan, keep=True)
    p = f.primal
    bwd = BwdOperands(p.consts, p.xs, p.kd, f.res, [True] * sum(pert.carry),
                      [True] * sum(pert.ys))  # fmt: skip
    return tuple(AtPoint(bwd, p.cconsts, p.init, p.n).flat())


lin_p.def_abstract_eval(_lin_abstract_eval)
lin_p.def_impl(_eager(lin_p, _tangent_kernel))
mlir.register_lowering(lin_p, mlir.lower_fun(_lin_impl, multiple_results=True))
batching.primitive_batchers[lin_p] = _lin_batch
ad.primitive_jvps[lin_p] = _lin_jvp
ad.primitive_transposes[lin_p] = _lin_transpose


# ----------------------------------------------------------------------------- bwd_p rules


def _bwd_batch(args, dims, *, loop, batch, pert, plan, use_ext):
    if not _per_sample_draws(loop):
        params = dict(loop=loop, batch=batch, pert=pert, plan=plan, use_ext=use_ext)
        outs = _one_at_a_time(bwd_p, args, dims, params)
        return outs, [0] * len(outs)
    flags = tuple(d is not None for d in dims)
    if AtPoint.split(flags, loop, pert, plan).bwd.res.stored.stride:
        use_ext = False  # the forward pass ran batched here: its residual buffers are empty
    level = Level(_size(args, dims), flags, reduce=False)
    at = AtPoint.split(list(range(len(args))), loop, pert, plan).bwd.res
    args = _moved(args, dims, set(at.stored.buf))
    outs = bwd_p.bind(*args, loop=loop, batch=batch + (level,), pert=pert, plan=plan,
                      use_ext=use_ext)  # fmt: skip
    return outs, [0] * len(outs)


def _bwd_jvp(primals, tangents, *, loop, batch, pert, plan, use_ext):
    """The backward pass's tangent: ``dbwd_p``, the derivative of the loop's vjp at the point
    ``bwd_p`` carries, the residuals' tangents unread (see :mod:`dyndepth._second_order`)."""
    outs = bwd_p.bind(*primals, loop=loop, batch=batch, pert=pert, plan=plan, use_ext=use_ext)
    at = AtPoint.split(primals, loop, pert, plan)
    t = AtPoint.split(tangents, loop, pert, plan)
    x, t_x = at.loop_operands(), t.loop_operands()

    def live(ps, ts):  # (a float leaf whose tangent is not a symbolic zero)
        return tuple(type(d) is not ad.Zero and jnp.issubdtype(jax.typeof(v).dtype, jnp.inexact)
                     for v, d in zip(ps, ts, strict=True))  # fmt: skip

    mask = TangentMask(live(x.consts, t_x.consts), live(x.init, t_x.init), live(x.xs, t_x.xs))
    t_ct = [*t.bwd.ct_carry, *t.bwd.ct_ys]
    if not (any(mask.consts + mask.init + mask.xs) or any(type(c) is not ad.Zero for c in t_ct)):
        return outs, _zeros_for(outs)

    def tangent_ops(p, d, ct):  # (for the tangents and for a level's flags alike)
        dx = d.loop_operands()
        return TangentOperands(p, take(dx.consts, mask.consts), take(dx.init, mask.init),
                               take(dx.xs, mask.xs), ct.bwd.ct_carry, ct.bwd.ct_ys)  # fmt: skip

    zi = AtPoint.split([ad.instantiate_zeros(d) for d in tangents], loop, pert, plan)
    ops = tangent_ops(at, zi, zi)
    levels = []
    for lv in batch:
        f = AtPoint.split(lv.batched, loop, pert, plan)
        levels.append(dataclasses.replace(lv, batched=tuple(tangent_ops(f, f, f).flat())))
    t_out = dbwd_p.bind(*ops.flat(), loop=loop, batch=tuple(levels), pert=pert, plan=plan,
                        mask=mask)  # fmt: skip
    return outs, t_out


_register(bwd_p, "bwd")
batching.primitive_batchers[bwd_p] = _bwd_batch
ad.primitive_jvps[bwd_p] = _bwd_jvp
_per_device.needs_devices_when_lowered(loop_p, bwd_p)


# ----------------------------------------------------------------------------- dbwd_p rules
# The backward pass's tangent: evaluated by forward mode through the kernels, transposed and
# differentiated as the "masked" loop's same map (see dyndepth._second_order).


def _dbwd_batch(args, dims, *, loop, batch, pert, plan, mask):
    params = dict(loop=loop, batch=batch, pert=pert, plan=plan, mask=mask)
    if not _per_sample_draws(loop):
        outs = _one_at_a_time(dbwd_p, args, dims, params)
        return outs, [0] * len(outs)
    level = Level(_size(args, dims), tuple(d is not None for d in dims), reduce=False)
    args = _moved(args, dims, set(_second_order.stored_at(len(args), loop, pert, plan, mask)))
    outs = dbwd_p.bind(*args, **dict(params, batch=batch + (level,)))
    return outs, [0] * len(outs)


def _dbwd_transpose(cts, *ops, loop, batch, pert, plan, mask):
    params = dict(loop=loop, batch=batch, pert=pert, plan=plan, mask=mask)
    n_point = len(TangentOperands.split(ops, loop, pert, plan, mask).point.flat())
    point, tangents = list(ops[:n_point]), ops[n_point:]
    if any(ad.is_undefined_primal(o) for o in point):
        raise ValueError("dbwd_p is linear in its tangents only")  # (JAX's rules never do it)
    undefined = [ad.is_undefined_primal(t) for t in tangents]
    at = [ad.instantiate_zeros(ad.Zero(t.aval)) if u else t
          for t, u in zip(tangents, undefined, strict=True)]  # fmt: skip
    _, pull = jax.vjp(lambda *t: _second_order.masked(*point, *t, **params), *at)
    grads = pull([ad.instantiate_zeros(c) for c in cts])
    return [None] * n_point + [g if u else None for g, u in zip(grads, undefined, strict=True)]


def _dbwd_jvp(primals, tangents, **params):
    tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
    return jax.jvp(lambda *ops: _second_order.masked(*ops, **params), tuple(primals), tangents)


_register(dbwd_p, "dbwd", partitions=False)
batching.primitive_batchers[dbwd_p] = _dbwd_batch
ad.primitive_jvps[dbwd_p] = _dbwd_jvp
ad.primitive_transposes[dbwd_p] = _dbwd_transpose


# ----------------------------------------------------------------------------- no reverse


_REVERSE_MSG = (
    'strategy="while" supports forward-mode differentiation (jvp, jacfwd) only; reverse mode '
    '(grad, vjp, jacrev) needs strategy="checkpointed" (or "auto", which picks it), whose '
    "forward and backward cost both follow the steps actually taken."
)


# ----------------------------------------------------------------------------- binding


def run(loop: Loop, consts, cconsts, init, xs, n, kd) -> tuple[list, list, Any, Any]:
    """Bind the loop: ``(carry, ys, steps, stats)``."""
    kd = jnp.zeros((), jnp.uint32) if kd is None else kd
    ops = LoopOperands(list(consts), list(cconsts), list(init), list(xs), n, kd)
    outs = loop_p.bind(*ops.flat(), loop=loop, batch=(), store=False, plan=None, pert=None)
    outs = LoopOutputs.split(outs, loop, store=False)
    return outs.carry, outs.ys, outs.steps, outs.stats
