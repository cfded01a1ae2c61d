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

from . import _batched, _budget, _schedule, _single, _vma
from ._leaves import broadcast_rows, merge, take
from ._per_device import Across, partitioning, per_device
from ._residuals import ResidualPlan
from ._step import Loop, Perturbed


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
            pert: Perturbed | None, operands: list) -> list:  # fmt: skip
    """Run the loop. ``operands``: consts, cconsts, init, xs, n, kd. Returns the flat outputs:
    carry, ys, steps, stats, and with ``store`` buf, stride, ext."""
    loop = _budget.fitted(loop, batch)
    nk, ncc, nc = loop.n_consts, loop.n_cconsts, len(loop.carry_avals)
    nx = len(loop.x_avals)
    consts, cconsts = operands[:nk], operands[nk : nk + ncc]
    init = operands[nk + ncc : nk + ncc + nc]
    xs = operands[nk + ncc + nc : nk + ncc + nc + nx]
    n, kd = operands[-2], operands[-1]
    kd = None if loop.keys is None else kd
    if not batch:
        carry, ys, steps, res, stats = _single.forward(
            loop, consts, cconsts, init, xs, n, kd, store=store, pert=pert, plan=plan
        )
        return _flat_forward(carry, ys, steps, stats, res)
    if len(batch) > 1:
        inner = lambda *ops: forward(loop, batch[:-1], store, plan, pert, list(ops))  # noqa: E731
        # Every output gains the outer axis but the stored-residual buffers (unfilled, shared).
        out_axes = [0] * (nc + len(loop.y_avals) + 2)
        stats = nc + len(loop.y_avals) + 1
        shared = {stats: _batched.merge_stats}  # the inner loops' stats, combined
        if store:
            n_ext = 0 if plan is None else len(plan.stored)
            out_axes += [0] * (nc + 1) + [None] * n_ext
            shared.update({len(out_axes) - n_ext + j: _same for j in range(n_ext)})
        return _outer_vmap(
            inner, batch, operands, out_axes, partial(_combine_stats, nc, loop), shared
        )
    return _forward_rows(loop, batch[0], store, plan, consts, cconsts, init, xs, n, kd)


def _flat_forward(carry, ys, steps, stats, res) -> list:
    out = [*carry, *ys, steps, stats]
    if res is not None:
        buf, stride, ext = res
        out += [*buf, stride, *ext]
    return out


def _same(value, across):
    """A value every device holds alike (an unfilled buffer)."""
    return value


def _summed(value, across):
    return across.sum(value)


def _combine_stats(nc: int, loop: Loop, out: list) -> list:
    """After a vmap over an outer level: the stats of every inner loop, combined."""
    pos = nc + len(loop.y_avals) + 1
    out[pos] = _batched.merge_stats(out[pos], Across())
    return out


def _forward_rows(loop, level, store, plan, consts, cconsts, init, xs, n, kd) -> list:
    nk, ncc, nc, nx = len(consts), len(cconsts), len(init), len(xs)
    flags = level.batched
    cb, ccb = flags[:nk], flags[nk : nk + ncc]
    ib, xb = flags[nk + ncc : nk + ncc + nc], flags[nk + ncc + nc : nk + ncc + nc + nx]
    nb, kb = flags[-2], flags[-1]
    R = level.size
    init = broadcast_rows(init, ib, R)
    xs = broadcast_rows(xs, xb, R)
    n = broadcast_rows([n], [nb], R)[0]
    kd = None if kd is None else broadcast_rows([kd], [kb], R)[0]
    per_sample = _per_sample_steps(loop, nb)
    c_axes, cc_axes = _axes(cb), _axes(ccb)

    def run(consts, cconsts, init, xs, n, kd):
        args = (loop, consts, c_axes, cconsts, cc_axes, init, xs, n, kd)
        rows = n.shape[0]
        if not (per_sample and _schedulable(loop, rows)):
            return _batched.forward(*args, store=store)
        if loop.cond_jaxpr is None:
            return _schedule.run_with_slots(
                n, _schedule.SlotRule.for_loop(loop, rows),
                lambda: _batched.forward(*args, store=store),
                lambda queue, S: _schedule.forward_wrapped(
                    *args, store=store, slots=S, queue=queue
                ),
            )  # fmt: skip
        # Stopping steps are unknown before the loop runs: continuous batching in a quarter of
        # the rows, all of them where iterations cost more than rows (or the given slots).
        slots = _schedule.refill_slots(loop.slots, rows, _schedule.fixed_rows(loop))
        if slots >= rows:
            return _batched.forward(*args, store=store)
        return _schedule.forward_refill(*args, store=store, slots=slots)

    # Under plain jit with the rows sharded over Explicit mesh axes: one loop per device.
    in_b = (list(cb), list(ccb), [True] * nc, [True] * nx, True, _leaf_or_none(kd))
    carry, ys, steps, res, stats = per_device(
        run, (consts, cconsts, init, xs, n, kd), in_b, (n, init, xs), (_batched.merge_stats,)
    )
    # A shared depth (and no predicate) leaves the steps unbatched: the backward pass then
    # runs in lockstep, unscheduled (nothing to save).
    steps = steps if per_sample else _shared_steps(steps)
    if store:
        # A batched forward pass stores carries only; the stored-residual buffers of a plan
        # (made for an unbatched loop) stay empty, and the backward pass recomputes.
        res = (res[0], res[1], [_vma.zeros((loop.max_steps,), a) for a in plan.stored]
               if plan is not None else [])  # fmt: skip
    return _flat_forward(carry, ys, steps, stats, res)


def _shared_steps(steps):
    """The one step count of rows that share their depth. Rows sharded over ``Explicit`` mesh
    axes are typed with the split, where taking row 0 is a slice JAX refuses: their maximum
    (the same value, reduced once, after the loop) instead."""
    return steps[0] if _vma.type_mesh(steps) is None else steps.max()


def _leaf_or_none(kd):
    """The batched flag of the key data: True, or None (an empty subtree) without keys."""
    return None if kd is None else True


def _axes(flags) -> list:
    return [0 if b else None for b in flags]


# ----------------------------------------------------------------------------- backward


def backward(loop: Loop, batch: Batch, pert: Perturbed, plan: ResidualPlan | None,
             use_ext: bool, operands: list) -> list:  # fmt: skip
    """The reverse sweep. ``operands``: consts, xs, kd, steps, buf, stride, ext, ct_carry and
    ct_ys (perturbed leaves). Returns the cotangents of the perturbed consts, init and xs."""
    nk, nx, nc = loop.n_consts, len(loop.x_avals), len(loop.carry_avals)
    if nc:  # the checkpoints the forward pass stored, whatever batch it ran over
        loop = _budget.matching(loop, operands[nk + nx + 2], loop.carry_avals[0])
    ne = 0 if plan is None else len(plan.stored)
    consts, xs = operands[:nk], operands[nk : nk + nx]
    kd, steps = operands[nk + nx], operands[nk + nx + 1]
    pos = nk + nx + 2
    buf, stride, ext = (
        operands[pos : pos + nc],
        operands[pos + nc],
        operands[pos + nc + 1 : pos + nc + 1 + ne],
    )
    cts = operands[pos + nc + 1 + ne :]
    ct_c, ct_y = cts[: sum(pert.carry)], cts[sum(pert.carry) :]
    kd = None if loop.keys is None else kd
    if not batch:
        use = plan if use_ext else None
        res = (buf, stride, ext)
        out = _single.backward(loop, pert, use, consts, xs, kd, res, steps, ct_c, ct_y)
        return [*out[0], *out[1], *out[2]]
    if len(batch) > 1:
        inner = lambda *ops: backward(loop, batch[:-1], pert, plan, use_ext, list(ops))  # noqa: E731
        level = batch[-1]
        kflags = take(level.batched[:nk], pert.consts)

        summed = [level.reduce and not b for b in kflags]

        def reduce(out):
            # A const shared by this level's elements gets their cotangents summed when the
            # level was batched before differentiation.
            k = [g.sum(0) if s else g for g, s in zip(out[: len(kflags)], summed, strict=True)]
            return k + out[len(kflags) :]

        shared = {i: _summed for i, s in enumerate(summed) if s}
        return _outer_vmap(inner, batch, operands, 0, reduce, shared)
    return _backward_rows(loop, batch[0], pert, plan, use_ext, consts, xs, kd, steps, buf, stride,
                          ext, ct_c, ct_y, operands)  # fmt: skip


def _backward_rows(loop, level, pert, plan, use_ext, consts, xs, kd, steps, buf, stride, ext,
                   ct_c, ct_y, operands) -> list:  # fmt: skip
    nk, nx, nc = len(consts), len(xs), len(buf)
    flags = level.batched
    cb, xb, kb, sb = flags[:nk], flags[nk : nk + nx], flags[nk + nx], flags[nk + nx + 1]
    rb = flags[nk + nx + 2 + nc]  # stride: batched iff the forward pass ran batched here
    R = level.size
    if not rb:
        # The forward pass ran unbatched at this level and only the cotangents (and perhaps
        # consts) are batched, as in jacrev: the unbatched sweep, mapped over them.
        inner = lambda *ops: backward(loop, (), pert, plan, use_ext, list(ops))  # noqa: E731
        return jax.vmap(inner, in_axes=_axes(flags), axis_size=R)(*operands)
    xs = broadcast_rows(xs, xb, R)
    kd = None if kd is None else broadcast_rows([kd], [kb], R)[0]
    steps = broadcast_rows([steps], [sb], R)[0]
    buf = broadcast_rows(buf, flags[nk + nx + 2 : nk + nx + 2 + nc], R)
    stride = broadcast_rows([stride], [rb], R)[0]
    ct_flags = flags[len(flags) - len(ct_c) - len(ct_y) :]
    ct_c = broadcast_rows(ct_c, ct_flags[: len(ct_c)], R)
    ct_y = broadcast_rows(ct_y, ct_flags[len(ct_c) :], R)
    c_axes = _axes(cb)
    per_row = not level.reduce

    # Which const cotangents have a row axis: a per-row const's, and every one kept per row.
    k_rows = [ax == 0 or per_row for ax in take(c_axes, pert.consts)]

    def run(consts, xs, kd, buf, stride, steps, ct_c, ct_y):
        args = (loop, pert, consts, c_axes, xs, kd, (buf, stride), steps, ct_c, ct_y)
        if sb and not loop.thinning and _schedulable(loop, steps.shape[0]):
            acc, ct, ct_xs = _schedule.run_with_slots(
                steps, _schedule.SlotRule.for_loop(loop, steps.shape[0]),
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
    args = (consts, xs, kd, buf, stride, steps, ct_c, ct_y)
    in_b = (list(cb), [True] * nx, _leaf_or_none(kd), [True] * nc, True, True,
            [True] * len(ct_c), [True] * len(ct_y))  # fmt: skip
    ct, ct_xs, acc_rows, acc_shared = per_device(
        run, args, in_b, (steps, buf, ct_c), (lambda acc, across: [across.sum(a) for a in acc],)
    )
    return [*merge(acc_rows, acc_shared, k_rows), *ct, *ct_xs]
