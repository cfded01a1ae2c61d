"""The loop over a batch of rows in lockstep: forward and backward sweeps.

Every row steps at every iteration until it is done (``i >= n`` or its predicate fails), its
carry then frozen by a mask, so a batch costs ``rows x max(steps)`` sample-steps. Consts carry
an axis spec: ``None`` (shared by the rows: never broadcast) or ``0`` (one per row). The
scheduler (:mod:`dyndepth._schedule`) runs the same steps with less waste; this module also
serves unbatched loops with checkpoint thinning (a batch of one).

The forward pass stores, with ``store``, per row the carry before every step, or with
``checkpoints=K`` at most ``K`` carries evenly spaced over the steps taken (the spacing doubles
when the slots fill up). The backward pass recomputes each segment between two checkpoints
into a buffer and sweeps it in reverse.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import _sharding, _store, _vma
from ._budget import recompute_slots
from ._derivative import Perturbed
from ._leaves import (
    IN_BOUNDS,
    at_index,
    merge,
    put_index,
    rows_mask,
    take,
    where_rows,
)
from ._step import Loop

# A loop's stats: forward iterations and executed sample-steps, the backward pass's (zero
# without one), and the carries stored per sample.
STATS_WIDTH = 5


def stats_of(iterations, rows, backward=(0, 0), stored=0):
    """The stats vector: ``[iterations, iterations x rows, *backward, stored]`` (int32)."""
    return jnp.stack([iterations, iterations * rows, *backward, stored]).astype(jnp.int32)


def merge_stats(stats, across):
    """Stats of loops run side by side (a stacked leading axis, and ``across`` devices): the
    longest loop (and the most carries stored), the sum of executed steps."""
    stats = stats.reshape(-1, STATS_WIDTH)
    longest = across.max(jnp.max(stats, axis=0))
    # (the even columns: iterations, and the carries stored; no array constant: the loops run
    # inside custom_partitioning, which takes none)
    even = jax.lax.iota(jnp.int32, STATS_WIDTH) % 2 == 0
    return jnp.where(even, longest, across.sum(jnp.sum(stats, axis=0)))


# ----------------------------------------------------------------------------- backward


def rows_vjp(loop: Loop, pert: Perturbed, consts, c_axes, carry, x, key, ct_c, ct_y, act, *,
             per_row: bool):  # fmt: skip
    """One step's vjp on a batch of rows; rows where ``act`` is false contribute nothing.

    Returns cotangents ``(g_consts, g_carry, g_x)`` of the perturbed leaves. A const with axis 0
    gets one cotangent per row. A shared const (axis ``None``) gets the sum over the rows (one
    vjp of the batched step: the cheap form, right for the gradient of a batched function) or,
    with ``per_row``, one cotangent per row (right under ``vmap`` of a per-sample vjp, where
    each sample's gradient of the shared const is its own)."""
    kp, cp, xp = pert.consts, pert.carry, pert.xs
    d_axes = take(c_axes, kp)
    # Inactive rows (finished samples, idle slots, steps past a short segment) hold carries the
    # loop never reached, where the step's Jacobian may be inf/NaN: with a zero cotangent, 0 * NaN
    # would still poison the shared-parameter sum. They are evaluated at an active row's inputs
    # instead, a point of a genuine trajectory, and their zero cotangent then contributes 0.
    # (A gather, not _leaves.idle_rows_at's select: with the select, the TPU compiler copied the
    # recompute buffer, 554 -> 790 MiB temp at B=4096, D=1024 in benchmarks/tpu.py.)
    B = act.shape[0]
    if not isinstance(B, int) or B > 1:  # (a symbolic batch size under jax.export: not an int)
        src = jnp.where(act, jnp.arange(B), jnp.argmax(act))
        carry = [c[src] for c in carry]
        x = [a[src] for a in x]
        key = None if key is None else key[src]
        consts = [c[src] if ax == 0 else c for c, ax in zip(consts, c_axes, strict=True)]
    ct_c = [jnp.where(rows_mask(act, c), c, 0) for c in ct_c]
    ct_y = [jnp.where(rows_mask(act, c), c, 0) for c in ct_y]

    def pullback(step, k_d, k_n, c_d, c_n, x_d, x_n, k, ct_c, ct_y):
        def f(k_d, c_d, x_d):
            new_c, y = step(merge(k_d, k_n, kp), merge(c_d, c_n, cp), merge(x_d, x_n, xp), k)
            return take(new_c, cp), take(y, pert.ys)

        return jax.vjp(f, k_d, c_d, x_d)[1]((ct_c, ct_y))

    # Inside shard_map, a vjp with respect to a replicated const would psum its cotangent over
    # the devices, a collective inside a loop whose trip count differs per device (a deadlock).
    # Varying consts (and xs) keep the per-device cotangents local; the caller sums them once
    # at the end. The carry keeps its loop-state type, which varies over the batch's axes.
    args = (
        _vma.vary(take(consts, kp)), take(consts, kp, False),
        take(carry, cp), take(carry, cp, False),
        _vma.vary(take(x, xp)), take(x, xp, False),
        key, ct_c, ct_y,
    )  # fmt: skip
    if per_row:
        axes = (list(d_axes), list(take(c_axes, kp, False))) + (0,) * 7
        g_k, g_c, g_x = jax.vmap(lambda *a: pullback(loop.step, *a), in_axes=axes,
                                 axis_size=B)(*args)  # fmt: skip
        return [jnp.where(rows_mask(act, g), g, 0) for g in g_k], g_c, g_x
    g_k, g_c, g_x = pullback(loop.vstep(c_axes, B), *args)
    any_act = jnp.any(act)
    g_k = [
        jnp.where(rows_mask(act, g), g, 0) if ax == 0 else jnp.where(any_act, g, 0)
        for g, ax in zip(g_k, d_axes, strict=True)
    ]
    return g_k, g_c, g_x


def cotangent_state(pert: Perturbed, consts, c_axes, xs, ct_carry, B: int, per_row) -> dict:
    """A backward pass's loop state before its first step: the carries' cotangents ``cur``
    (``ct_carry``), and zero accumulators for the perturbed consts' (``acc``, see
    :func:`rows_vjp`; ``B`` rows) and the perturbed xs' (``ct_xs``, with a row axis)."""
    acc = []
    for c, ax in zip(take(consts, pert.consts), take(c_axes, pert.consts), strict=True):
        if ax is None and per_row:
            acc.append(_sharding.zeros((B,), _sharding.typed_aval(c)))
        else:
            acc.append(jnp.zeros_like(c))
    ct_xs = [jnp.zeros_like(a) for a in take(xs, pert.xs)]
    return dict(cur=list(ct_carry), acc=acc, ct_xs=ct_xs)


def backward(loop: Loop, pert: Perturbed, consts, c_axes, xs, kd, res, steps, ct_carry, ct_ys,
             *, per_row=False, x_axes=None):  # fmt: skip
    """The reverse sweep of :func:`forward` from its stored carries. ``ct_carry``/``ct_ys``
    hold the perturbed leaves only.

    Returns the cotangents after it (:func:`cotangent_state`: a shared const's summed over the
    rows, or per row with ``per_row``). ``x_axes``: per xs leaf, 0 (a row axis, the default) or
    None (shared by the rows, read at each row's step, never broadcast)."""
    buf, stride = res
    B = steps.shape[0]
    S = _store.max_stride(loop)
    x_axes = [0] * len(xs) if x_axes is None else x_axes

    def xs_at(idx):
        shared = lambda x: x.at[jnp.clip(idx, 0, x.shape[0] - 1)].get(**IN_BOUNDS)  # noqa: E731
        return [_store.cells([x], None, idx, 1)[0] if ax == 0 else shared(x)
                for x, ax in zip(xs, x_axes, strict=True)]  # fmt: skip

    vstep = loop.vstep(c_axes, B)
    nseg = (steps + stride - 1) // stride
    rounds = jnp.max(nseg, initial=0)

    def reverse_step(s, idx, state_c, act):
        x = xs_at(idx)
        ct_y = _store.cells(ct_ys, None, idx, 1)
        g_k, g_c, g_x = rows_vjp(loop, pert, consts, c_axes, state_c, x, loop.key_at(kd, idx),
                                 s["cur"], ct_y, act, per_row=per_row)  # fmt: skip
        s = dict(s)
        s["acc"] = [a + g for a, g in zip(s["acc"], g_k, strict=True)]
        s["cur"] = where_rows(act, g_c, s["cur"])
        s["ct_xs"] = _store.put_cells(s["ct_xs"], None, idx, g_x, act, 1)
        return s

    state = cotangent_state(pert, consts, c_axes, xs, ct_carry, B, per_row)
    start = dict(state, r=jnp.zeros((), jnp.int32))
    # One segment's recomputed carries, allocated once for every segment; a long segment
    # recomputes its sub-checkpoints first (``lb1``), then each sub-segment into ``lb``. Both
    # are step-major, (position, row, ...): every row writes and reads one shared position
    # per iteration, a contiguous slice.
    inner, sub = recompute_slots(S)
    if S > 1:
        start["lb"] = [_sharding.zeros((inner, B), a) for a in loop.carry_avals]
    if sub:
        start["lb1"] = [_sharding.zeros((sub, B), a) for a in loop.carry_avals]

    def segment_body(s):
        j = nseg - 1 - s["r"]
        seg_act = j >= 0
        start = jnp.maximum(j, 0) * stride
        length = jnp.where(seg_act, jnp.minimum(stride, steps - start), 0)
        c0 = _store.read(buf, None, jnp.maximum(j, 0))
        if S == 1:
            s = reverse_step(s, start, c0, seg_act)
        elif not sub:
            s = _recompute_and_unwind(loop, vstep, consts, xs_at, kd, s, start, length, c0,
                                      reverse_step)  # fmt: skip
        else:
            s = _two_level(loop, vstep, consts, xs_at, kd, s, start, length, c0, reverse_step)
        s = dict(s)
        s["r"] = s["r"] + 1
        return s

    out = _vma.while_loop(lambda s: s["r"] < rounds, segment_body, start)
    return {k: out[k] for k in state}


def backward_iterations(loop: Loop, steps: jax.Array, stride: jax.Array) -> jax.Array:
    """The loop iterations :func:`backward` runs (each over every row), its loops counted as
    they run: per segment round, one vjp (stride 1), or the recompute then the unwind of the
    round's longest segment, in two levels for long ones."""
    S = _store.max_stride(loop)
    nseg = (steps + stride - 1) // stride
    rounds = jnp.arange(loop.slots_stored)
    j = nseg[None, :] - 1 - rounds[:, None]  # (round, row): the segment each row undoes
    length = jnp.where(j >= 0, jnp.minimum(stride, steps - jnp.maximum(j, 0) * stride), 0)
    played = rounds < jnp.max(nseg, initial=0)
    if S == 1:
        return jnp.sum(played.astype(jnp.int32))
    inner, sub = recompute_slots(S)
    if not sub:
        return jnp.sum(jnp.where(played, _unwound(jnp.max(length, axis=1, initial=0)), 0))
    nsub = (length + inner - 1) // inner
    first = jnp.max((nsub - 1) * inner, axis=1, initial=0)  # the sub-checkpoints' recompute
    q = jnp.arange(S // inner)[:, None, None]
    sub_len = jnp.clip(length[None] - q * inner, 0, inner)
    longest = jnp.max(nsub, axis=1, initial=0)[None]
    subs = jnp.where(q[:, :, 0] < longest, _unwound(jnp.max(sub_len, 2, initial=0)), 0)
    return jnp.sum(jnp.where(played, jnp.maximum(first, 0) + jnp.sum(subs, axis=0), 0))


def _unwound(tmax: jax.Array) -> jax.Array:
    """Iterations of :func:`_recompute_and_unwind` over a longest segment of ``tmax``."""
    return jnp.where(tmax > 0, 2 * tmax - 1, 0)


def _recompute(vstep, loop: Loop, consts, xs_at, kd, start, length, c0, buf, every: int, upto):
    """Run the steps ``start + t - 1`` for ``t`` in ``[1, upto)`` from ``c0`` (rows with
    ``t < length``), storing the carry before step ``start + t`` in ``buf[t // every]`` where
    ``every`` divides ``t``."""

    def body(rs):
        t, c, b = rs
        act = t < length
        idx = start + t - 1
        new_c, _ = vstep(consts, c, xs_at(idx), loop.key_at(kd, idx))
        c = where_rows(act, new_c, c)
        b = put_index(b, t // every, c, act & (t % every == 0))
        return t + 1, c, b

    return _vma.while_loop(lambda rs: rs[0] < upto, body, (jnp.ones((), jnp.int32), c0, buf))[2]


def _two_level(loop: Loop, vstep, consts, xs_at, kd, s, start, length, c0, reverse_step):
    """One segment as :func:`_recompute_and_unwind` does it, in two levels: its carries every
    ``inner`` steps into ``s["lb1"]``, then each sub-segment of ``inner`` steps, last first,
    recomputed into ``s["lb"]`` and unwound (one more forward pass over the segment, for a
    buffer of ``sqrt``-size pieces instead of one as long as the segment)."""
    inner = s["lb"][0].shape[0]
    s = dict(s)
    lb1 = put_index(s.pop("lb1"), 0, c0)
    nsub = (length + inner - 1) // inner
    lb1 = _recompute(vstep, loop, consts, xs_at, kd, start, length, c0, lb1, inner,
                     jnp.max((nsub - 1) * inner, initial=0) + 1)  # fmt: skip

    def sub_segment(qs):
        q, s = qs
        sub_len = jnp.clip(length - q * inner, 0, inner)
        c0q = at_index(lb1, q)
        s = _recompute_and_unwind(loop, vstep, consts, xs_at, kd, s, start + q * inner, sub_len,
                                  c0q, reverse_step)  # fmt: skip
        return q - 1, s

    s = _vma.while_loop(lambda qs: qs[0] >= 0, sub_segment, (jnp.max(nsub, initial=0) - 1, s))[1]
    return dict(s, lb1=lb1)


def _recompute_and_unwind(loop: Loop, vstep, consts, xs_at, kd, s, start, length, c0, reverse_step):
    """Recompute one segment's carries from its checkpoint ``c0`` into the buffer ``s["lb"]``,
    then apply the reverse steps over it, last step first (a segment reads only the positions
    it wrote, so the buffer is never cleared)."""
    s = dict(s)
    lb0 = put_index(s.pop("lb"), 0, c0)
    tmax = jnp.max(length, initial=0)
    lb = _recompute(vstep, loop, consts, xs_at, kd, start, length, c0, lb0, 1, tmax)

    def unwind(us):
        t, s = us
        state_c = at_index(lb, t)
        return t - 1, reverse_step(s, start + t, state_c, t < length)

    s = _vma.while_loop(lambda us: us[0] >= 0, unwind, (tmax - 1, s))[1]
    return dict(s, lb=lb)
