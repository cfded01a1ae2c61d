"""The one place that decides how a loop runs.

A loop primitive carries its batch structure (:class:`Level`, innermost first: what ``vmap``
added, and which operands each level batches). From it and the loop's strategy, this module
picks the kernel:

* no batch: the unbatched loop (:mod:`dyndepth._single`), with stored residuals when planned;
* several levels: ``jax.vmap`` over the outer ones of the kernel for the innermost, once per
  device on its shard of the outermost level when that level is sharded;
* the innermost level (the *rows*): when the steps differ per row, ``"auto"`` runs the
  per-sample scheduler (:mod:`dyndepth._schedule`) and ``"checkpointed"``/``"while"`` the
  lockstep batch (:mod:`dyndepth._batched`); rows that share their steps run in lockstep; a
  backward pass whose residuals are shared by the rows (only the cotangents batched, as in
  ``jacrev``) is the unbatched sweep mapped over the cotangents;
* under plain ``jit`` with the rows sharded over a mesh (the outermost level's, with several
  levels), one kernel per device (:func:`dyndepth._per_device.per_device`).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax

from . import _batched, _budget, _schedule, _sharding, _single
from ._derivative import Perturbed
from ._leaves import broadcast_rows, merge, take
from ._operands import BwdOperands, Cotangents, LoopOperands, LoopOutputs, Stored, n_stored
from ._per_device import Across, partitioning, per_device
from ._residuals import ResidualPlan
from ._step import Loop


@dataclasses.dataclass(frozen=True)
class Level:
    """One batch level: its size, which operands it batches, and (backward passes only)
    whether a const's cotangent is summed over it (``reduce``: the level was batched before
    differentiation, as in ``grad(vmap(f))``) or kept per element (``vmap(grad(f))``)."""

    size: Any
    batched: tuple[bool, ...]
    reduce: bool = True


Batch = tuple[Level, ...]


def lead(batch: Batch) -> tuple:
    """Leading axes of an operand batched at every level (outermost first)."""
    return tuple(level.size for level in reversed(batch))


def _per_sample_steps(loop: Loop, n_batched: bool) -> bool:
    """Whether rows of a batched loop can stop at different steps."""
    return bool(n_batched) or loop.cond_jaxpr is not None


def _schedulable(loop: Loop, rows: Any) -> bool:
    return loop.strategy == "auto" and isinstance(rows, int) and rows > 1


def _outer_vmap(fn, batch: Batch, operands, out_axes, finish, shared):
    """``fn`` mapped over the outermost level with ``jax.vmap``; ``finish`` turns the mapped
    outputs into the final ones.

    When that level is sharded over a mesh, the map runs once per device on its shard (a loop
    inside ``vmap`` stops when its last element does, so a map over every device's elements
    would put a collective over the batch axis inside the loop). ``shared`` maps the position of
    each output not batched over the level to ``merge(value, across)``, which combines it over
    the devices."""
    level = batch[-1]
    flags = list(level.batched)

    def run(*ops):
        # this device's share of the level (all of it on one device)
        size = next((op.shape[0] for op, b in zip(ops, flags, strict=True) if b), level.size)
        mapped = jax.vmap(fn, in_axes=_axes(flags), out_axes=out_axes, axis_size=size)
        with partitioning(False):  # the inner levels' kernels already run on this device
            return finish(list(mapped(*ops)))

    def split(*ops):  # (outputs batched over the level, the shared ones)
        out = run(*ops)
        return [v for i, v in enumerate(out) if i not in shared], [out[i] for i in shared]

    def combine(values, across):
        return [merge_one(v, across) for merge_one, v in zip(shared.values(), values, strict=True)]

    probe = [op for op, b in zip(operands, flags, strict=True) if b]
    # (a parameter split over `model` is gathered: under this map, the inner loops' switch over
    # slot counts becomes a select whose cases a `model` split would type unlike its index)
    kept, merged = per_device(
        split, tuple(operands), tuple(flags), probe, (combine,), gather_params=True
    )
    out = list(kept)
    for i, v in sorted(zip(shared, merged, strict=True), key=lambda p: p[0]):
        out.insert(i, v)
    return out


# ----------------------------------------------------------------------------- forward


def forward(loop: Loop, batch: Batch, store: bool, plan: ResidualPlan | None,
            pert: Perturbed | None, ops: LoopOperands) -> list:  # fmt: skip
    """Run the loop. Returns the flat :class:`dyndepth._operands.LoopOutputs` (with ``store``,
    what the backward pass needs)."""
    loop = _budget.fitted(loop, batch)
    kd = None if loop.keys is None else ops.kd
    if not batch:
        carry, ys, steps, res, stats = _single.forward(
            loop, ops.consts, ops.cconsts, ops.init, ops.xs, ops.n, kd, store=store, pert=pert,
            plan=plan,
        )  # fmt: skip
        return _flat_forward(carry, ys, steps, stats, res)
    if len(batch) == 1:
        return _forward_rows(loop, batch[0], store, plan, dataclasses.replace(ops, kd=kd))

    def inner(*flat):
        return forward(loop, batch[:-1], store, plan, pert, LoopOperands.split(flat, loop))

    nc, ny, n_ext = len(loop.carry_avals), len(loop.y_avals), n_stored(plan)
    # Every output gains the outer axis but the stored-residual buffers (unfilled, shared).
    axes = LoopOutputs([0] * nc, [0] * ny, 0, 0,
                       Stored([0] * nc, 0, [None] * n_ext) if store else None)  # fmt: skip
    # What the devices combine: the inner loops' stats; the unfilled buffers are alike.
    merges = LoopOutputs([None] * nc, [None] * ny, None, _batched.merge_stats,
                         Stored([None] * nc, None, [_same] * n_ext) if store else None)  # fmt: skip
    shared = {i: m for i, m in enumerate(merges.flat()) if m is not None}
    return _outer_vmap(inner, batch, ops.flat(), axes.flat(),
                       partial(_combine_stats, loop, store, n_ext), shared)  # fmt: skip


def _flat_forward(carry, ys, steps, stats, res) -> list:
    stored = None if res is None else Stored(list(res[0]), res[1], list(res[2]))
    return LoopOutputs(list(carry), list(ys), steps, stats, stored).flat()


def _same(value, across):
    """A value every device holds alike (an unfilled buffer)."""
    return value


def _summed(value, across):
    return across.sum(value)


def _combine_stats(loop: Loop, store: bool, n_ext: int, out: list) -> list:
    """After a vmap over an outer level: the stats of every inner loop, combined."""
    outs = LoopOutputs.split(out, loop, store, n_ext)
    return dataclasses.replace(outs, stats=_batched.merge_stats(outs.stats, Across())).flat()


def _forward_rows(loop, level, store, plan, ops: LoopOperands) -> list:
    flags = LoopOperands.split(level.batched, loop)
    R = level.size
    init = broadcast_rows(ops.init, flags.init, R)
    xs = broadcast_rows(ops.xs, flags.xs, R)
    n = broadcast_rows([ops.n], [flags.n], R)[0]
    kd = None if ops.kd is None else broadcast_rows([ops.kd], [flags.kd], R)[0]
    per_sample = _per_sample_steps(loop, flags.n)
    c_axes, cc_axes = _axes(flags.consts), _axes(flags.cconsts)

    def run(consts, cconsts, init, xs, n, kd):
        args = (loop, consts, c_axes, cconsts, cc_axes, init, xs, n, kd)
        rows = n.shape[0]
        if not (per_sample and _schedulable(loop, rows)):
            return _batched.forward(*args, store=store)
        if loop.cond_jaxpr is None:
            return _schedule.run_with_slots(
                n, _schedule.SlotRule.for_loop(loop, rows, consts, c_axes),
                lambda: _batched.forward(*args, store=store),
                lambda queue, S: _schedule.forward_wrapped(
                    *args, store=store, slots=S, queue=queue
                ),
            )  # fmt: skip
        # Stopping steps are unknown before the loop runs: continuous batching in a quarter of
        # the rows, all of them where iterations cost more than rows (or the given slots).
        slots = _schedule.refill_slots(loop.slots, rows, _schedule.fixed_rows(loop, consts, c_axes))
        if slots >= rows:
            return _batched.forward(*args, store=store)
        return _schedule.forward_refill(*args, store=store, slots=slots)

    # Under plain jit with the rows sharded over Explicit mesh axes: one loop per device.
    nc, nx = len(init), len(xs)
    in_b = (list(flags.consts), list(flags.cconsts), [True] * nc, [True] * nx, True,
            _leaf_or_none(kd))  # fmt: skip
    carry, ys, steps, res, stats = per_device(
        run, (ops.consts, ops.cconsts, init, xs, n, kd), in_b, (n, init, xs),
        (_batched.merge_stats,),
    )  # fmt: skip
    # A shared depth (and no predicate) leaves the steps unbatched: the backward pass then
    # runs in lockstep, unscheduled (nothing to save).
    steps = steps if per_sample else _shared_steps(steps)
    if store:
        # A batched forward pass stores carries only; the stored-residual buffers of a plan
        # (made for an unbatched loop) stay empty, and the backward pass recomputes.
        buf, stride = res[0], res[1]  # (the batched kernels return no stored residuals)
        ext = [] if plan is None else [_sharding.zeros((loop.max_steps,), a) for a in plan.stored]
        res = (buf, stride, ext)
    return _flat_forward(carry, ys, steps, stats, res)


def _shared_steps(steps):
    """The one step count of rows that share their depth. Rows sharded over ``Explicit`` mesh
    axes are typed with the split, where taking row 0 is a slice JAX refuses: their maximum
    (the same value, reduced once, after the loop) instead."""
    return steps[0] if _sharding.type_mesh(steps) is None else steps.max()


def _leaf_or_none(kd):
    """The batched flag of the key data: True, or None (an empty subtree) without keys."""
    return None if kd is None else True


def _axes(flags) -> list:
    return [0 if b else None for b in flags]


# ----------------------------------------------------------------------------- backward


def backward(loop: Loop, batch: Batch, pert: Perturbed, plan: ResidualPlan | None,
             use_ext: bool, ops: BwdOperands) -> list:  # fmt: skip
    """The reverse sweep. Returns the flat :class:`dyndepth._operands.Cotangents` (of the
    perturbed consts, init and xs leaves)."""
    if loop.carry_avals:  # the checkpoints the forward pass stored, whatever batch it ran over
        loop = _budget.matching(loop, ops.res.stored.buf[0], loop.carry_avals[0])
    if not batch:
        stored = ops.res.stored
        use = plan if use_ext else None
        kd = None if loop.keys is None else ops.kd
        out = _single.backward(loop, pert, use, ops.consts, ops.xs, kd,
                               (stored.buf, stored.stride, stored.ext), ops.res.steps,
                               ops.ct_carry, ops.ct_ys)  # fmt: skip
        return Cotangents(*out).flat()
    if len(batch) == 1:
        return _backward_rows(loop, batch[0], pert, plan, use_ext, ops)

    def inner(*flat):
        return backward(loop, batch[:-1], pert, plan, use_ext,
                        BwdOperands.split(flat, loop, pert, plan))  # fmt: skip

    level = batch[-1]
    flags = BwdOperands.split(level.batched, loop, pert, plan)
    # A const shared by this level's elements gets their cotangents summed when the level was
    # batched before differentiation.
    summed = [level.reduce and not b for b in take(flags.consts, pert.consts)]

    def reduce(out):
        g = Cotangents.split(out, pert)
        k = [c.sum(0) if s else c for c, s in zip(g.consts, summed, strict=True)]
        return dataclasses.replace(g, consts=k).flat()

    shared = {i: _summed for i, s in enumerate(summed) if s}  # (the consts' come first)
    return _outer_vmap(inner, batch, ops.flat(), 0, reduce, shared)


def _backward_rows(loop, level, pert, plan, use_ext, ops: BwdOperands) -> list:
    flags = BwdOperands.split(level.batched, loop, pert, plan)
    R = level.size
    if not flags.res.stored.stride:
        # The forward pass ran unbatched at this level and only the cotangents (and perhaps
        # consts) are batched, as in jacrev: the unbatched sweep, mapped over them.
        def unbatched(*flat):
            return backward(
                loop, (), pert, plan, use_ext, BwdOperands.split(flat, loop, pert, plan)
            )

        return jax.vmap(unbatched, in_axes=_axes(flags.flat()), axis_size=R)(*ops.flat())
    res, res_b = ops.res, flags.res
    xs = broadcast_rows(ops.xs, flags.xs, R)
    kd = None if loop.keys is None else broadcast_rows([ops.kd], [flags.kd], R)[0]
    steps = broadcast_rows([res.steps], [res_b.steps], R)[0]
    buf = broadcast_rows(res.stored.buf, res_b.stored.buf, R)
    stride = broadcast_rows([res.stored.stride], [True], R)[0]
    ct_c = broadcast_rows(ops.ct_carry, flags.ct_carry, R)
    ct_y = broadcast_rows(ops.ct_ys, flags.ct_ys, R)
    c_axes = _axes(flags.consts)
    per_row = not level.reduce
    # Which const cotangents have a row axis: a per-row const's, and every one kept per row.
    k_rows = [ax == 0 or per_row for ax in take(c_axes, pert.consts)]

    def run(consts, xs, kd, buf, stride, steps, ct_c, ct_y):
        args = (loop, pert, consts, c_axes, xs, kd, (buf, stride), steps, ct_c, ct_y)
        if res_b.steps and not loop.thinning and _schedulable(loop, steps.shape[0]):
            acc, ct, ct_xs = _schedule.run_with_slots(
                steps, _schedule.SlotRule.for_loop(loop, steps.shape[0], consts, c_axes),
                lambda: _batched.backward(*args, per_row=per_row),
                lambda queue, S: _schedule.backward_wrapped(
                    *args, per_row=per_row, slots=S, queue=queue
                ),
            )  # fmt: skip
        else:
            acc, ct, ct_xs = _batched.backward(*args, per_row=per_row)
        return ct, ct_xs, take(acc, k_rows), take(acc, k_rows, False)

    # Under plain jit with the rows sharded over Explicit mesh axes: one loop per device; the
    # shared consts' cotangents are summed over the devices afterwards.
    nx, nc = len(xs), len(buf)
    args = (ops.consts, xs, kd, buf, stride, steps, ct_c, ct_y)
    in_b = (list(flags.consts), [True] * nx, _leaf_or_none(kd), [True] * nc, True, True,
            [True] * len(ct_c), [True] * len(ct_y))  # fmt: skip
    ct, ct_xs, acc_rows, acc_shared = per_device(
        run, args, in_b, (steps, buf, ct_c), (lambda acc, across: [across.sum(a) for a in acc],)
    )
    return Cotangents(merge(acc_rows, acc_shared, k_rows), ct, ct_xs).flat()
