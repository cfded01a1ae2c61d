"""The batched loop kernels: the forward and the backward sweep over a batch of rows, on a
schedule (:mod:`dyndepth._schedule`).

Every operand with a row axis has the batch's ``B`` rows; ``axes`` (a
:class:`dyndepth._operands.LoopOperands` of ``0``/``None``) says which consts and xs leaves have
one (``None``: shared by the rows, never broadcast). At every iteration each of the schedule's
``S`` slots reads its sample's carry from that sample's row, applies the step (or its vjp) and
writes the result back; only live slots write. The body does nothing else: the schedule's
bookkeeping is one small table read per iteration, and a lockstep schedule reads and writes
rows in place (no gather, no scatter).

The forward pass stores, with ``store``, the carries of :mod:`dyndepth._store`. The backward
pass reads every carry from it, or, with thinned checkpoints, runs each sample's units of
:func:`dyndepth._store.backward_unit` (its segments recomputed into the store's free slots,
then undone), so that its work follows the sample's steps too.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from . import _schedule, _sharding, _store, _vma
from ._batched import cotangent_state
from ._derivative import Perturbed
from ._leaves import DROP, IN_BOUNDS, idle_rows_at, index_in, merge, rows_mask, take
from ._operands import BwdOperands, LoopOperands
from ._schedule import ALONE, Slots, Turn, at_slots, put_slots
from ._step import Loop


def _per_slot(leaves: list, axes: list, b: Any) -> list:
    """Each slot's row of the leaves with a row axis (axis 0); shared ones (axis None) as they
    are."""
    return [at_slots([x], b)[0] if ax == 0 else x for x, ax in zip(leaves, axes, strict=True)]


def _steps_of(i: jax.Array, slots: int) -> jax.Array:
    return jnp.broadcast_to(i, (slots,))


def _xs_at(xs: list, axes: list, b: Any, i: jax.Array, slots: int) -> list:
    """Each slot's ``x``: ``xs[b, i]`` for per-sample xs, ``xs[i]`` for shared ones."""
    out = []
    for x, ax in zip(xs, axes, strict=True):
        if ax is None:
            if jnp.ndim(i) == 0:
                v = index_in(x, i, 0)
            else:
                v = x.at[jnp.clip(i, 0, x.shape[0] - 1)].get(**IN_BOUNDS)
            out.append(jnp.broadcast_to(v, (slots,) + v.shape[jnp.ndim(i) :]))
        else:
            out.append(_store.cells([x], b, i, 1)[0])
    return out


def _put_ys(ys: list, view: Slots, values: list) -> list:
    """``ys[b, i] = y`` for the live slots (``ys`` zero elsewhere, as the loop's outputs are)."""
    if not ys:
        return ys
    return _store.put_cells(ys, view.b, view.i, values, view.live, 1)


def _keys(loop: Loop, kd: Any, rows: Any, i: jax.Array, slots: int) -> Any:
    """Each slot's key: its sample's step ``i``'s."""
    if kd is None:
        return None
    return loop.key_at(at_slots([kd], rows)[0], _steps_of(i, slots))


# ----------------------------------------------------------------------------- forward


def forward(loop: Loop, ops: LoopOperands, axes: LoopOperands, sched: Any, *, store: bool,
            strides: jax.Array | None = None, in_order: str | None = None,
            turn: Turn = ALONE) -> tuple:  # fmt: skip
    """The loop over the rows of ``ops`` on the schedule ``sched``, on its ``turn``. Returns
    ``(state, summary)``: the loop state after it (``cur``, the carries; ``ys``; with ``store``
    the ``store`` of :mod:`dyndepth._store`, its ``strides`` set up front where the steps are
    known, else grown as it fills) and what the run leaves beside it (:func:`forward_outputs`).
    With ``in_order`` (a wrap-around ``sched``; ``"where it fits"`` or ``"when sure"``, see
    :func:`_writer`) the store is in schedule order (:func:`dyndepth._store.put_in_order`;
    the summary's ``in_order``, per sample, the slot count where it is, else 0)."""
    B = ops.n.shape[0]
    S = sched.slots
    vstep = loop.vstep(axes.consts, S)
    kd = ops.kd
    state = turn.state
    if state is None:
        state = dict(cur=list(ops.init), ys=[_sharding.zeros((B, loop.max_steps), a)
                                             for a in loop.y_avals])  # fmt: skip
        if store:
            state["store"] = _store.start(loop, list(ops.init), strides)
    if store:
        put, fits = _writer(loop, sched, B, in_order)
    sched = sched.masking(list(ops.init) + _per_step(state["ys"]))

    def body(s):
        s = dict(s)
        t = s["t"]
        view = sched.view(s["sched"], t)
        carry = at_slots(s["cur"], view.b)
        if store:
            s["store"] = put(s["store"], t, view, carry)
        x = _xs_at(ops.xs, axes.xs, view.b, view.i, S)
        new, y = vstep(_per_slot(ops.consts, axes.consts, view.b), carry, x,
                       _keys(loop, kd, view.b, view.i, S))  # fmt: skip
        s["cur"] = put_slots(s["cur"], view.b, list(new), view.live)
        s["ys"] = _put_ys(s["ys"], view, list(y))
        s["sched"] = sched.advance(s["sched"], view, list(new))
        s["t"] = t + 1
        return s

    start = dict(state, t=jnp.zeros((), jnp.int32), sched=sched.start(list(ops.init)))
    running = lambda s: turn.gate(sched.running(s["sched"], s["t"]))  # noqa: E731
    out = _vma.while_loop(running, body, start)
    summary = dict(steps=sched.steps(out["sched"]), iterations=out["t"], slots=S)
    if store:
        stride = out["store"]["stride"]
        summary["stride"], summary["in_order"] = _in_order_strides(fits, S, stride)
    return {k: out[k] for k in state}, summary


def forward_outputs(state: dict, summary: dict) -> tuple:
    """``(carry, ys, steps, res, (iterations, slots))`` of a forward pass's ``state`` and
    ``summary`` (:func:`forward`), ``res`` the store's ``(buf, stride, in_order)`` (None
    without a store)."""
    res = None
    if "store" in state:
        res = (state["store"]["buf"], summary["stride"], summary["in_order"])
    return (state["cur"], state["ys"], summary["steps"], res,
            (summary["iterations"], summary["slots"]))  # fmt: skip


def _writer(loop: Loop, sched: Any, B: int, in_order: str | None) -> tuple:
    """``(put, fits)``: how the forward pass stores each iteration's carries, ``put(store, t,
    view, carry)``: in schedule order (:func:`dyndepth._store.put_in_order`) where ``fits`` (a
    scalar, or a bool where it is known when traced), else per sample
    (:func:`dyndepth._store.put`). Only where the slots divide the rows (the ladder's counts of
    a batch of a power of two); then a store of every carry always fits, and a thinned one,
    with ``in_order="where it fits"``, where the schedule's iterations are few enough (checked
    before the loop; each iteration then writes one way or the other, a conditional)."""

    def per_sample(store, t, view, carry):
        return _store.put(loop, store, view.b, view.i, carry, view.live)

    def ordered(store, t, view, carry):
        return _store.put_in_order(store, t, carry, sched.slots)

    if in_order is None or B % sched.slots:
        return per_sample, False
    if not loop.thinning:
        return ordered, True
    if in_order != "where it fits":
        return per_sample, False
    fits = _store.fits_in_order(sched.iterations, sched.slots, loop.slots_stored, B)

    def either(store, t, view, carry):
        return _vma.cond(fits, lambda st: ordered(st, t, view, carry),
                         lambda st: per_sample(st, t, view, carry), store)  # fmt: skip

    return either, fits


def _in_order_strides(fits: Any, slots: int, stride: jax.Array) -> tuple:
    """Per sample, the store's ``(stride, in_order)`` after a forward pass whose store is in
    schedule order in ``slots`` slots where ``fits`` (see :func:`_writer`), else per sample at
    ``stride``. (No array constant: the kernels may run inside ``custom_partitioning``, which
    takes none.)"""
    zero = stride * 0
    if fits is True:
        return zero + 1, zero + slots
    if fits is False:
        return stride, zero
    return jnp.where(fits, 1, stride), jnp.where(fits, slots, zero)


def stop_predicate(loop: Loop, cconsts: list, cc_axes: list) -> Any:
    """The loop's stop predicate over a schedule's slots, ``holds(b, carry)``, or None."""
    if loop.cond_jaxpr is None:
        return None

    def holds(b, carry):
        rows = jnp.shape(jax.tree_util.tree_leaves(carry)[0])[0]
        return loop.vcond(cc_axes, rows)(_per_slot(cconsts, cc_axes, b), carry)

    return holds


def lockstep(loop: Loop, ops: LoopOperands, axes: LoopOperands, *, store: bool,
             turn: Turn = ALONE) -> tuple:  # fmt: skip
    """:func:`forward` with every sample in its own slot: until its depth, or while its stop
    predicate holds."""
    holds = stop_predicate(loop, ops.cconsts, axes.cconsts)
    if holds is not None:
        sched = _schedule.LockstepWhile(ops.n, holds)
        return forward(loop, ops, axes, sched, store=store, turn=turn)
    n = ops.n.astype(jnp.int32)
    strides = _store.strides_for(n, loop.slots_stored) if store else None
    return forward(loop, ops, axes, _schedule.Lockstep(n), store=store, strides=strides,
                   turn=turn)  # fmt: skip


# ----------------------------------------------------------------------------- backward


def slot_vjp(loop: Loop, pert: Perturbed, consts, c_axes, carry, x, key, ct_c, ct_y, live, *,
             per_row: bool):  # fmt: skip
    """One step's vjp on the slots; slots that are not ``live`` contribute nothing (their
    inputs are a point of some sample's trajectory, their cotangents zero).

    Returns cotangents ``(g_consts, g_carry, g_x)`` of the perturbed leaves (a const with
    axis 0 one per slot; a shared const (axis ``None``) summed over the slots, or with
    ``per_row`` one per slot: ``vmap`` of a per-sample vjp) and the step's new carry."""
    kp, cp, xp = pert.consts, pert.carry, pert.xs
    S = live.shape[0]
    ct_c = [jnp.where(rows_mask(live, c), c, 0) for c in ct_c]
    ct_y = [jnp.where(rows_mask(live, c), c, 0) for c in ct_y]

    def pullback(step, k_d, k_n, c_d, c_n, x_d, x_n, k, ct_c, ct_y):
        def f(k_d, c_d, x_d):
            new_c, y = step(merge(k_d, k_n, kp), merge(c_d, c_n, cp), merge(x_d, x_n, xp), k)
            return (take(new_c, cp), take(y, pert.ys)), list(new_c)

        _, pullback, new_c = jax.vjp(f, k_d, c_d, x_d, has_aux=True)
        return pullback((ct_c, ct_y)) + (new_c,)

    # Inside shard_map, a vjp with respect to a replicated const would psum its cotangent over
    # the devices, a collective inside a loop whose trip count differs per device: varying
    # consts (and xs) keep the per-device cotangents local; the caller sums them once.
    args = (
        _vma.vary(take(consts, kp)), take(consts, kp, False),
        take(carry, cp), take(carry, cp, False),
        _vma.vary(take(x, xp)), take(x, xp, False),
        key, ct_c, ct_y,
    )  # fmt: skip
    if per_row:
        in_axes = (list(take(c_axes, kp)), list(take(c_axes, kp, False))) + (0,) * 7
        return jax.vmap(lambda *a: pullback(loop.step, *a), in_axes=in_axes, axis_size=S)(*args)
    return pullback(loop.vstep(c_axes, S), *args)


def backward(loop: Loop, pert: Perturbed, ops: BwdOperands, c_axes: list, x_axes: list,
             sched: Any, *, per_row: bool, in_order: bool = False,
             turn: Turn = ALONE) -> tuple:  # fmt: skip
    """The reverse sweep over the rows on ``sched``, a reverse schedule of each sample's
    backward units (its steps, or with thinning :func:`dyndepth._store.units`; ``i`` counts
    them down), on its ``turn``. ``ops.ct_carry``/``ops.ct_ys`` hold the perturbed leaves
    only. Returns ``(state, iterations)``: the cotangents after it
    (:func:`dyndepth._batched.cotangent_state`) and the iterations run.

    ``in_order`` (every carry stored, ``sched`` wrap-around): where the forward pass wrote the
    store in schedule order in as many slots, it ran the samples' steps in the positions of
    ``sched`` (the same rule on the same steps), and the carries are read there."""
    B = ops.res.steps.shape[0]
    S = sched.slots
    kd = ops.kd
    d_axes = take(c_axes, pert.consts)
    # (a const's cotangent with a row axis: a per-sample const's, or each sample's own)
    rows = [ax == 0 or per_row for ax in d_axes]
    state = turn.state
    if state is None:
        state = cotangent_state(pert, ops.consts, c_axes, ops.xs, ops.ct_carry, B, per_row)
    start = dict(state, t=jnp.zeros((), jnp.int32), sched=sched.start([]))
    buf = list(ops.res.stored.buf)
    # With thinning, each sample's segment is recomputed into rows of its own; per sample its
    # steps and stride, read with one gather per iteration.
    if loop.thinning:
        R = _store.recompute_rows(loop)
        start["rec"] = [_sharding.blank((R, B), a) for a in loop.carry_avals]
        layout = jnp.stack([ops.res.steps.astype(jnp.int32), ops.res.stored.stride])
    ordered = jnp.any(ops.res.stored.in_order == S) if in_order else None

    # (the stored carries' shapes are also those of the carries' cotangents)
    sched = sched.masking([c[0] for c in buf] + _per_step(ops.ct_ys)
                          + _per_step(take(ops.xs, [ax == 0 for ax in x_axes]))
                          + take(ops.consts, [ax == 0 for ax in c_axes])
                          + take(state["acc"], rows))  # fmt: skip

    def body(s):
        s = dict(s)
        t = s["t"]
        view = sched.view(s["sched"], t)
        b, live, src = view.b, view.live, view.rows
        if loop.thinning:
            n, stride = layout.at[:, src].get(**IN_BOUNDS)
            recompute, j, p, seg = _store.backward_unit(n, stride, _store.units(n, stride) - 1
                                                         - view.i)  # fmt: skip
            stored = _store.read(buf, src, seg)
            again = _store.read(s["rec"], src, p - 1)
            carry = [jnp.where(rows_mask(p == 0, c), c, a)
                     for c, a in zip(stored, again, strict=True)]  # fmt: skip
            undo = live & ~recompute
        else:  # (every carry stored: slot j)
            j, undo = view.i, live
            col, k = src, j
            if in_order:
                k_o, col_o = _store.in_order_cells(sched, B, src, j)
                col, k = jnp.where(ordered, col_o, src), jnp.where(ordered, k_o, j)
            carry = _idle_fill(view, _store.read_in_loop(buf, col, k, t))
        x = _idle_fill(view, _xs_at(ops.xs, x_axes, src, j, S), x_axes)
        ct_y = _store.cells(ops.ct_ys, src, j, 1)
        consts = _idle_fill(view, _per_slot(ops.consts, c_axes, src), c_axes)
        keys = None if kd is None else _idle_fill(view, [at_slots([kd], src)[0]])[0]
        g_k, g_c, g_x, new_c = slot_vjp(
            loop, pert, consts, c_axes, carry, x, _keys(loop, keys, None, j, S),
            at_slots(s["cur"], src), ct_y, undo, per_row=per_row,
        )  # fmt: skip
        if loop.thinning:
            s["rec"] = _store.put_cells(s["rec"], b, p, new_c, live & recompute, 0)
        s["cur"] = put_slots(s["cur"], b, list(g_c), undo)
        s["acc"] = [_add_rows(a, b, g, undo) if r else a + g
                    for a, g, r in zip(s["acc"], g_k, rows, strict=True)]  # fmt: skip
        s["ct_xs"] = _store.put_cells(s["ct_xs"], b, j, list(g_x), undo, 1)
        s["sched"] = sched.advance(s["sched"], view, [])
        s["t"] = t + 1
        return s

    running = lambda s: turn.gate(sched.running(s["sched"], s["t"]))  # noqa: E731
    out = _vma.while_loop(running, body, start)
    return {k: out[k] for k in state}, out["t"]


def _per_step(leaves: list) -> list:
    """One step's slice ``x[:, 0]`` of batch-major ``(B, T, ...)`` leaves (``T > 0``): the
    shapes a loop masks of them."""
    return [x[:, 0] for x in leaves if x.shape[1]]


def _idle_fill(view: Slots, leaves: list, axes: list | None = None) -> list:
    """With ``view.fill`` set, :func:`dyndepth._leaves.idle_rows_at` row ``fill``."""
    return leaves if view.fill is None else idle_rows_at(view.live, view.fill, leaves, axes)


def _add_rows(acc: jax.Array, b: Any, g: jax.Array, live: jax.Array) -> jax.Array:
    """``acc[b[s]] += g[s]`` for the live slots (in place for a lockstep schedule)."""
    if b is None:
        return acc + jnp.where(rows_mask(live, g), g, 0)
    return acc.at[jnp.where(live, b, acc.shape[0])].add(g, **DROP)
