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
from collections.abc import Collection, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from . import (
    _batched,
    _budget,
    _cost,
    _kernels,
    _schedule,
    _sharding,
    _single,
    _slots,
    _store,
    _vma,
)
from ._derivative import Perturbed
from ._leaves import broadcast_rows, merge, take
from ._operands import (
    BwdOperands,
    Cotangents,
    LoopOperands,
    LoopOutputs,
    Residuals,
    Stored,
    n_stored,
)
from ._per_device import Across, partitioning, per_device, samples_keep_columns
from ._residuals import ResidualPlan
from ._schedule import ALONE, Turn
from ._step import Loop
from ._store import ROW_AXIS


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


def _outer_vmap(fn, level: Level, operands, in_axes, out_axes, finish, shared, prepare=None):
    """``fn`` mapped over the outermost ``level`` with ``jax.vmap`` (``in_axes``: each operand's
    axis of that level, or None); ``finish`` turns the mapped outputs into the final ones;
    ``prepare``, if given, the operands before the map (on each device's shard).

    When that level is sharded over a mesh, the map runs once per device on its shard (a loop
    inside ``vmap`` stops when its last element does, so a map over every device's elements
    would put a collective over the batch axis inside the loop). ``shared`` maps the position of
    each output not batched over the level to ``merge(value, across)``, which combines it over
    the devices."""

    def run(*ops):
        ops = ops if prepare is None else prepare(list(ops))
        # this device's share of the level (all of it on one device)
        size = next((op.shape[ax] for op, ax in zip(ops, in_axes, strict=True) if ax is not None),
                    level.size)  # fmt: skip
        # (the inner levels' kernels already run on this device; the map's axis is named, so
        # that their choices are made once over it: _slots.outer_level)
        with partitioning(False), _slots.outer_level() as name:
            mapped = jax.vmap(fn, in_axes=list(in_axes), out_axes=out_axes, axis_size=size,
                              axis_name=name)  # fmt: skip
            return finish(list(mapped(*ops)))

    def split(*ops):  # (outputs batched over the level, the shared ones)
        out = run(*ops)
        return [v for i, v in enumerate(out) if i not in shared], [out[i] for i in shared]

    def combine(values, across):
        return [merge_one(v, across) for merge_one, v in zip(shared.values(), values, strict=True)]

    probe = [op for op, ax in zip(operands, in_axes, strict=True) if ax == 0]
    kept_axes = (out_axes if isinstance(out_axes, int)
                 else [ax for i, ax in enumerate(out_axes) if i not in shared])  # fmt: skip
    # (a parameter split over `model` is gathered: under this map, the inner loops' switch over
    # slot counts becomes a select whose cases a `model` split would type unlike its index)
    in_batched = tuple(False if ax is None else ax for ax in in_axes)  # (per_device's flags)
    kept, merged = per_device(
        split, tuple(operands), in_batched, probe, (combine,), gather_params=True,
        out_axes=(kept_axes,),
    )  # fmt: skip
    out = list(kept)
    for i, v in sorted(zip(shared, merged, strict=True), key=lambda p: p[0]):
        out.insert(i, v)
    return out


# ----------------------------------------------------------------------------- forward


def forward(loop: Loop, batch: Batch, store: bool, plan: ResidualPlan | None,
            pert: Perturbed | None, ops: LoopOperands) -> list:  # fmt: skip
    """Run the loop. Returns the flat :class:`dyndepth._operands.LoopOutputs` (with ``store``,
    what the backward pass needs)."""
    # (the innermost level's rows are those a kernel runs)
    inner_n = LoopOperands.split(batch[0].batched, loop).n if batch else False
    loop = _budget.fitted(loop, batch, per_sample=_per_sample_steps(loop, inner_n))
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
    # Every output gains the outer axis (the stored carries after their slots) but the
    # stored-residual buffers (unfilled, shared).
    stored = Stored([ROW_AXIS] * nc, 0, 0, [None] * n_ext) if store else None
    axes = LoopOutputs([0] * nc, [0] * ny, 0, 0, stored)
    # What the devices combine: the inner loops' stats; the unfilled buffers are alike.
    combined = Stored([None] * nc, None, None, [_same] * n_ext) if store else None
    merges = LoopOutputs([None] * nc, [None] * ny, None, _batched.merge_stats, combined)
    shared = {i: m for i, m in enumerate(merges.flat()) if m is not None}
    return _outer_vmap(inner, batch[-1], ops.flat(), _axes(batch[-1].batched), axes.flat(),
                       partial(_combine_stats, loop, store, n_ext), shared)  # fmt: skip


def _flat_forward(carry, ys, steps, stats, res) -> list:
    stored = None if res is None else Stored(list(res[0]), res[1], res[2], list(res[3]))
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
    n = broadcast_rows([ops.n], [flags.n], R)[0]
    kd = None if ops.kd is None else broadcast_rows([ops.kd], [flags.kd], R)[0]
    per_sample = _per_sample_steps(loop, flags.n)
    # (xs shared by the rows, such as with_index's step index, stay shared: never broadcast)
    axes = LoopOperands(_axes(flags.consts), _axes(flags.cconsts), [0] * len(init),
                        _axes(flags.xs), 0, 0)  # fmt: skip

    def run(consts, cconsts, init, xs, n, kd):
        rows = LoopOperands(consts, cconsts, init, xs, n, kd)
        with jax.named_scope("dyndepth_forward"):  # (profiles name the loop's kernels)
            carry, ys, steps, res, (iters, S) = _forward_kernel(loop, rows, axes, per_sample,
                                                                store)  # fmt: skip
        if not store:
            return carry, ys, steps, res, _batched.stats_of(iters, S)
        back = _BackwardPlan.of(loop, steps, res[1], res[2], consts, axes.consts, per_sample)
        work = back.work(loop, steps, res[1])
        return carry, ys, steps, res, _batched.stats_of(iters, S, work, loop.slots_stored)

    # Under plain jit with the rows sharded over Explicit mesh axes: one loop per device.
    nc = len(init)
    in_b = (list(flags.consts), list(flags.cconsts), [True] * nc, list(flags.xs), True,
            _leaf_or_none(kd))  # fmt: skip
    carry, ys, steps, res, stats = per_device(
        run, (ops.consts, ops.cconsts, init, ops.xs, n, kd), in_b, (n, init),
        (_batched.merge_stats,), out_axes=(0, 0, 0, ([ROW_AXIS] * nc, 0, 0) if store else 0),
    )  # fmt: skip
    # A shared depth (and no predicate) leaves the steps unbatched: the backward pass then
    # runs in lockstep, unscheduled (nothing to save).
    steps = steps if per_sample else _shared_steps(steps)
    if store:
        # A batched forward pass stores carries only; the stored-residual buffers of a plan
        # (made for an unbatched loop) stay empty, and the backward pass recomputes.
        # (the batched kernels return no stored residuals)
        ext = [] if plan is None else [_sharding.blank((loop.max_steps,), a) for a in plan.stored]
        res = (*res, ext)
    return _flat_forward(carry, ys, steps, stats, res)


def _forward_kernel(loop: Loop, ops: LoopOperands, axes: LoopOperands, per_sample: bool,
                    store: bool) -> tuple:  # fmt: skip
    """How a batch of rows runs forward: in lockstep, or, under ``"auto"`` with per-sample
    steps, on the wrap-around schedule in a slot count chosen at run time (known depths) or by
    continuous batching (a stop predicate). Returns :func:`dyndepth._kernels.forward_outputs`."""
    rows = ops.n.shape[0]
    if not (per_sample and _schedulable(loop, rows)):
        return _kernels.forward_outputs(*_kernels.lockstep(loop, ops, axes, store=store))
    if loop.cond_jaxpr is not None:
        # Stopping steps are unknown before the loop runs: continuous batching in a quarter of
        # the rows, all of them where iterations cost more than rows (or the given slots).
        rule = _slots.SlotRule.for_loop(loop, rows, ops.consts, axes.consts)
        slots = _slots.refill_slots(loop.slots, rows, rule.fixed_rows, rule.moved_rows)
        if slots >= rows:
            return _kernels.forward_outputs(*_kernels.lockstep(loop, ops, axes, store=store))
        holds = _kernels.stop_predicate(loop, ops.cconsts, axes.cconsts)
        sched = _schedule.Refill(slots, ops.n, holds, *_refill_order(loop, ops, axes, holds))
        return _kernels.forward_outputs(*_kernels.forward(loop, ops, axes, sched, store=store))
    n = ops.n.astype(jnp.int32)
    strides = _store.strides_for(n, loop.slots_stored) if store else None
    in_order = _store_in_order()

    def run(S, turn):
        if S >= rows:
            return _kernels.lockstep(loop, ops, axes, store=store, turn=turn)
        sched = _schedule.Wrap.of(n, S, runs=turn.runs)
        return _kernels.forward(loop, ops, axes, sched, store=store, strides=strides,
                                in_order=in_order, turn=turn)  # fmt: skip

    rule = _slots.SlotRule.for_loop(loop, rows, ops.consts, axes.consts)
    pick = lambda: _forward_pick(loop, rule, n, store, in_order)  # noqa: E731
    return _kernels.forward_outputs(*_ladder(rule, pick, run, _chains()))


def _forward_pick(loop: Loop, rule: _slots.SlotRule, n: jax.Array, store: bool,
                  in_order: str | None) -> jax.Array:  # fmt: skip
    """Index into ``rule.candidates`` of the forward pass's slot count: the rule's choice,
    except where a wrap-around pass would scatter rows into a thinned store laid out with its
    rows along the lanes (:func:`dyndepth._cost.rows_on_lanes`: the compiler moves the whole
    store every iteration). There only counts whose schedule writes the store in schedule
    order (:func:`dyndepth._store.fits_in_order`, blocks, no scatter) stay; the others give way
    to lockstep, whose rows write slices."""
    choice = rule.choose(n)
    rows, K = n.shape[0], loop.slots_stored
    on_lanes = any(_cost.rows_on_lanes((K, rows, *a.shape), a.dtype) for a in loop.carry_avals)
    if not (store and loop.thinning and in_order == "where it fits" and on_lanes):
        return choice
    total, longest = jnp.sum(n), jnp.max(n, initial=0)

    def fits(S):
        iterations = _slots.iterations(total, longest, S)
        return S >= rows or (rows % S == 0 and _store.fits_in_order(iterations, S, K, rows))

    # (a count that does not fit one outer element's rows is left out for all of them)
    misfit = jnp.stack([jnp.logical_not(fits(S)).astype(jnp.int32) for S in rule.candidates])
    ok = _slots.worst_over_levels(misfit) == 0
    return jnp.where(ok[choice], choice, rule.candidates.index(rows))


def _store_in_order() -> str | None:
    """How a wrap-around forward pass traced now may write its store in schedule order
    (:mod:`dyndepth._store`): ``"where it fits"`` (a check before the loop, a conditional
    write in it), ``"when sure"`` (only where it fits by the loop's shapes: XLA's GPU runtime
    reads a conditional's predicate on the host, a wait every iteration) or None: a loop XLA
    partitions keeps each sample's carries in its own column
    (:func:`dyndepth._per_device.samples_keep_columns`)."""
    if samples_keep_columns():
        return None
    return "where it fits" if _cost.conditionals_on_device() else "when sure"


def _chains(thinned_backward: bool = False) -> bool:
    """Whether the slot counts' loops run as one chain (:class:`dyndepth._schedule.Turn`), not
    under a conditional: on a TPU (:func:`dyndepth._cost.keeps_loop_state_in_fast_memory`: a
    conditional's output left a weight's cotangent out of the chip's fast memory, a long tail
    at 1.19x the time of its chosen count alone), but for a thinned store's backward passes
    (chained, a TPU v5e kept the weights out of its fast memory: 1.27x the time of a long
    tail's value_and_grad; benchmarks/README.md, "One chain of loops, no conditional").
    Elsewhere a conditional: XLA's GPU runtime reads a loop's predicate on the host (once for
    each loop of a chain), and a CPU pays 15-20 us for each chained loop that does not run
    (benchmarks/README.md, "A CPU's ladder under one conditional")."""
    return _cost.keeps_loop_state_in_fast_memory() and not thinned_backward


def _ladder(rule: _slots.SlotRule, pick, run, chained: bool) -> tuple:
    """``run(S, turn)`` (a kernel's ``(state, summary)``) in the slot count ``S`` chosen at
    run time among the ``rule``'s candidates, the one at index ``pick()``; ``chained``: every
    candidate's loop one after another, each running only on its own turn
    (:class:`dyndepth._schedule.Turn`), the loop state passed from one to the next, and the
    chosen one's summary; else a conditional over the candidates. One loop, run as is, with
    one candidate."""
    if len(rule.candidates) == 1:
        return run(rule.candidates[0], ALONE)

    def scoped(S, turn):
        with jax.named_scope(f"dyndepth_slots_{S}"):
            return run(S, turn)

    if not chained:
        return _vma.switch(pick(), [partial(scoped, S, ALONE) for S in rule.candidates])
    chosen = pick()
    state, summaries = None, []
    for k, S in enumerate(rule.candidates):
        state, summary = scoped(S, Turn(chosen == k, state))
        summaries.append(summary)

    def of_chosen(*values):
        out = values[0]
        for k, v in enumerate(values[1:], 1):
            out = jnp.where(chosen == k, v, out)
        return out

    return state, jax.tree_util.tree_map(of_chosen, *summaries)


def _refill_order(loop: Loop, ops: LoopOperands, axes: LoopOperands, holds) -> tuple:
    """``(order, pending)``: the order in which continuous batching starts the samples, those
    with steps to take first (``pending`` of them), by decreasing priority at ``init`` when the
    loop has one (a NaN counts as the lowest), in batch order among equals."""
    B = ops.n.shape[0]
    has = (ops.n > 0) & holds(None, list(ops.init))
    no_work = jnp.where(has, 0, 1)
    if not loop.priority:
        order = jnp.argsort(no_work, stable=True)
    else:
        prio = jax.vmap(loop.start_priority, in_axes=(list(axes.cconsts), 0),
                        axis_size=B)(ops.cconsts, list(ops.init))  # fmt: skip
        # (sorting puts NaNs last, after every number)
        order = jnp.lexsort((jnp.arange(B), -prio, no_work))
    return order.astype(jnp.int32), jnp.sum(has, dtype=jnp.int32)


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
        loop = _budget.matching(loop, ops.res.stored.buf[0])
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
    prepare = None
    if flags.res.steps and flags.res.stored.in_order and jnp.ndim(ops.res.stored.in_order) == 1:
        # The forward pass's rows (its store's one row axis), here mapped one sample at a time
        # (cotangents batched inside them, as in vmap(jacrev)): each sample's carries in its
        # column.
        def prepare(flat):
            b = BwdOperands.split(flat, loop, pert, plan)
            stored = b.res.stored
            buf, stride = _store.to_per_sample(stored.buf, stored.stride, stored.in_order,
                                               b.res.steps)  # fmt: skip
            stored = Stored(buf, stride, stored.in_order * 0, stored.ext)
            return dataclasses.replace(b, res=dataclasses.replace(b.res, stored=stored)).flat()

    # A const shared by this level's elements gets their cotangents summed when the level was
    # batched before differentiation.
    summed = [level.reduce and not b for b in take(flags.consts, pert.consts)]

    def reduce(out):
        g = Cotangents.split(out, pert)
        k = [c.sum(0) if s else c for c, s in zip(g.consts, summed, strict=True)]
        return dataclasses.replace(g, consts=k).flat()

    shared = {i: _summed for i, s in enumerate(summed) if s}  # (the consts' come first)
    return _outer_vmap(inner, level, ops.flat(), _bwd_axes(level.batched, loop, pert, plan), 0,
                       reduce, shared, prepare)  # fmt: skip


def _bwd_axes(batched: tuple, loop: Loop, pert: Perturbed, plan: ResidualPlan | None) -> list:
    """Each backward operand's axis of a batch level (its ``batched`` flags)."""
    at = BwdOperands.split(list(range(len(batched))), loop, pert, plan).res.stored.buf
    return level_axes(batched, at)


def level_axes(batched: Sequence[bool], stored_at: Collection[int] = ()) -> list:
    """Each operand's axis of a batch level: None (not batched), 0, or for the stored carries
    (at positions ``stored_at``) :data:`dyndepth._store.ROW_AXIS`, after their slots."""
    return [None if not b else ROW_AXIS if j in stored_at else 0 for j, b in enumerate(batched)]


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

        in_axes = _bwd_axes(level.batched, loop, pert, plan)
        return jax.vmap(unbatched, in_axes=in_axes, axis_size=R)(*ops.flat())
    res, res_b = ops.res, flags.res
    # Shared xs stay shared unless perturbed: their cotangents are per row (summed by the
    # transpose over the levels that did not batch them).
    x_shared = [not b and not p for b, p in zip(flags.xs, pert.xs, strict=True)]
    xs = [x if sh else broadcast_rows([x], [b], R)[0]
          for x, b, sh in zip(ops.xs, flags.xs, x_shared, strict=True)]  # fmt: skip
    x_axes = [None if sh else 0 for sh in x_shared]
    kd = None if loop.keys is None else broadcast_rows([ops.kd], [flags.kd], R)[0]
    steps = broadcast_rows([res.steps], [res_b.steps], R)[0]
    buf = broadcast_rows(res.stored.buf, res_b.stored.buf, R, ROW_AXIS)
    stride = broadcast_rows([res.stored.stride], [True], R)[0]
    in_order = broadcast_rows([res.stored.in_order], [res_b.stored.in_order], R)[0]
    ct_c = broadcast_rows(ops.ct_carry, flags.ct_carry, R)
    ct_y = broadcast_rows(ops.ct_ys, flags.ct_ys, R)
    c_axes = _axes(flags.consts)
    per_row = not level.reduce
    # Which const cotangents have a row axis: a per-row const's, and every one kept per row.
    k_rows = [ax == 0 or per_row for ax in take(c_axes, pert.consts)]

    def run(consts, xs, kd, buf, stride, in_order, steps, ct_c, ct_y):
        stored = Stored(buf, stride, in_order, [])
        bwd = BwdOperands(consts, xs, kd, Residuals(steps, stored), ct_c, ct_y)
        with jax.named_scope("dyndepth_backward"):
            acc, ct, ct_xs = _backward_kernel(loop, pert, bwd, c_axes, x_axes, res_b.steps,
                                              per_row)  # fmt: skip
        return ct, ct_xs, take(acc, k_rows), take(acc, k_rows, False)

    # Under plain jit with the rows sharded over Explicit mesh axes: one loop per device; the
    # shared consts' cotangents are summed over the devices afterwards.
    nc = len(buf)
    args = (ops.consts, xs, kd, buf, stride, in_order, steps, ct_c, ct_y)
    in_b = (list(flags.consts), [ax == 0 for ax in x_axes], _leaf_or_none(kd), [ROW_AXIS] * nc,
            True, True, True, [True] * len(ct_c), [True] * len(ct_y))  # fmt: skip
    ct, ct_xs, acc_rows, acc_shared = per_device(
        run, args, in_b, (steps, ct_c), (lambda acc, across: [across.sum(a) for a in acc],)
    )
    return Cotangents(merge(acc_rows, acc_shared, k_rows), ct, ct_xs).flat()


@dataclasses.dataclass(frozen=True)
class _BackwardPlan:
    """How a batch of rows runs backward from its stored carries: each sample's ``units`` (its
    steps, or with thinned checkpoints :func:`dyndepth._store.units`) in lockstep (``rule``
    None) or, under ``"auto"`` with per-sample steps, on the wrap-around schedule in a slot
    count the ``rule`` chooses at run time. With thinning, ``fits`` says whether every sample's
    segments fit :func:`dyndepth._store.recompute_rows`; else the batch takes the two-level
    lockstep sweep of :mod:`dyndepth._batched`. A store the forward pass wrote in schedule
    order (``in_order``, per sample its slot count) holds every carry (stride 1) where that
    schedule ran the steps: the backward pass runs in the same slot count (the same rule on the
    same steps chooses it; here it is taken as given)."""

    units: jax.Array
    rule: _slots.SlotRule | None
    fits: jax.Array | None
    in_order: jax.Array

    @staticmethod
    def of(loop: Loop, steps, stride, in_order, consts, c_axes, per_sample: bool) -> _BackwardPlan:
        rows = steps.shape[0]
        steps = steps.astype(jnp.int32)
        units = _store.units(steps, stride) if loop.thinning else steps
        rule = (_slots.SlotRule.for_loop(loop, rows, consts, c_axes)
                if per_sample and _schedulable(loop, rows) else None)  # fmt: skip
        fits = jnp.all(stride <= _store.recompute_rows(loop) + 1) if loop.thinning else None
        return _BackwardPlan(units, rule, fits, in_order)

    def pick(self) -> jax.Array:
        """Index into the rule's candidates of the slot count the pass runs in: the forward
        pass's where it wrote its store in schedule order, else the rule's choice."""
        forward = jnp.max(self.in_order, initial=0)
        ordered = jnp.stack([forward == c for c in self.rule.candidates])
        return jnp.where(jnp.any(ordered), jnp.argmax(ordered), self.rule.choose(self.units))

    def work(self, loop: Loop, steps, stride) -> tuple:
        """``(iterations, executed sample-steps)`` the backward pass will run (a thinned one
        counts its recompute units)."""
        rows = self.units.shape[0]
        if self.rule is None:
            S = jnp.asarray(rows, jnp.int32)
        else:
            pick = self.pick()
            S = sum(jnp.where(pick == k, c, 0) for k, c in enumerate(self.rule.candidates))
        its = _slots.iterations(jnp.sum(self.units), jnp.max(self.units, initial=0), S)
        if self.fits is None:
            return its, its * S
        two_level = _batched.backward_iterations(loop, steps.astype(jnp.int32), stride)
        return jnp.where(self.fits, its, two_level), jnp.where(self.fits, its * S, two_level * rows)


def _lockstep_at_end(loop: Loop) -> bool:
    """Whether a lockstep backward pass ends the samples' sweeps together (one shared step per
    iteration: the stored carries read as slices of the slot-major store) or starts them
    together (per-row reads: a thinned store's units are per row)."""
    return not loop.thinning


def _backward_kernel(loop: Loop, pert: Perturbed, ops: BwdOperands, c_axes, x_axes,
                     per_sample: bool, per_row: bool) -> tuple:  # fmt: skip
    """Run the backward pass of :class:`_BackwardPlan` over a batch of rows.

    A thinned store whose samples all kept every carry (stride 1: each sample's steps within
    its slots, as under a generous ``max_steps``, or the whole store in schedule order) runs
    the pass of the loop that stores every carry (:func:`dyndepth._budget.every_carry`): the
    same units, without the thinned pass's bookkeeping and its second read per unit (on a TPU
    v5e, 18% of a long tail's value_and_grad; ``benchmarks/README.md``, "Every carry kept
    under a thinned store")."""
    steps = ops.res.steps.astype(jnp.int32)
    stride = ops.res.stored.stride

    def scheduled(loop: Loop, plan: _BackwardPlan, thinned: bool) -> dict:
        rows = steps.shape[0]
        at_end = _lockstep_at_end(loop)

        def run(S, turn):
            if S >= rows:
                sched = _schedule.Lockstep(plan.units, reverse=True, at_end=at_end)
                return _kernels.backward(loop, pert, ops, c_axes, x_axes, sched,
                                         per_row=per_row, turn=turn)  # fmt: skip
            # (every carry stored: the store may be in the forward schedule's order)
            sched = _schedule.Wrap.of(plan.units, S, reverse=True, runs=turn.runs)
            return _kernels.backward(loop, pert, ops, c_axes, x_axes, sched, per_row=per_row,
                                     in_order=not loop.thinning, turn=turn)  # fmt: skip

        if plan.rule is None:
            return run(rows, ALONE)[0]
        return _ladder(plan.rule, plan.pick, run, _chains(thinned))[0]

    def plan_of(loop: Loop) -> _BackwardPlan:
        return _BackwardPlan.of(loop, steps, stride, ops.res.stored.in_order, ops.consts,
                                c_axes, per_sample)  # fmt: skip

    plan = plan_of(loop)
    if plan.fits is None:
        ct = scheduled(loop, plan, thinned=False)
    else:
        # A thinned store: its three backward passes under a conditional (see _chains).
        def two_level():
            return _batched.backward(loop, pert, ops.consts, c_axes, ops.xs, ops.kd,
                                     (ops.res.stored.buf, stride), steps, ops.ct_carry,
                                     ops.ct_ys, per_row=per_row, x_axes=x_axes)  # fmt: skip

        every = _budget.every_carry(loop)
        branches = [lambda: scheduled(every, plan_of(every), thinned=True),
                    lambda: scheduled(loop, plan, thinned=True), two_level]  # fmt: skip
        which = jnp.where(jnp.all(stride == 1), 0, jnp.where(plan.fits, 1, 2))
        ct = _vma.switch(which, branches)
    return ct["acc"], ct["cur"], ct["ct_xs"]
