"""Per-sample scheduling: continuous batching inside the loop, forward and backward.

A batch of ``B`` samples with per-sample step counts runs in ``S <= B`` *slots* (static shapes).
Every loop iteration applies the step to all slots at once. When a slot's sample finishes, its
carry is written out and the next pending sample is loaded into the slot, so the work done is
close to ``sum(steps)`` instead of ``B * max(steps)``. When the step counts are known up front
(``repeat``, ``scan``: the depths; the backward pass: the steps taken), samples start longest
first (LPT scheduling), which keeps the tail short. For ``while_loop`` the stopping step is only
known when a sample stops; samples then start in batch order and a slot takes the next pending
sample the moment it frees (greedy list scheduling).

Every sample is stepped with its own keys (``step_key(key_b, i)`` for its step ``i``), xs and
per-sample parameters, so results equal the unscheduled loop's.

All of it is one ``lax.while_loop`` with static shapes and no host round-trips.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from . import _vma
from ._engine import (
    Problem,
    acc_shapes,
    backward_batched,
    forward_batched,
    is_diff,
    rows_vjp,
    stats_of,
    take,
    where_b,
)


def slot_candidates(batch: int) -> tuple[int, ...]:
    """Slot counts that ``slots=None`` chooses from at run time: ``B, B/2, B/4, B/8`` (rounded
    up); batches of 8 or fewer run unscheduled (one candidate, ``B``)."""
    if batch <= 8:
        return (batch,)
    return tuple(sorted({math.ceil(batch / f) for f in (1, 2, 4, 8)}, reverse=True))


def choose_slots(lengths: jax.Array, candidates: tuple[int, ...]) -> jax.Array:
    """Index into ``candidates`` of the largest slot count that the lengths keep busy.

    ``sum(lengths) / max(lengths)`` slots can all stay busy until the longest sample is done;
    with fewer slots the loop takes more iterations but wastes nothing, with more it wastes the
    difference. The choice is the largest candidate ``<= 1.1 * sum / max`` (else the smallest),
    so that executed sample-steps stay within about 10% of ``sum(lengths)`` while the number of
    loop iterations stays close to ``max(lengths)``.
    """
    total = jnp.sum(lengths).astype(jnp.float32)
    busy = total / jnp.maximum(jnp.max(lengths), 1).astype(jnp.float32)
    cands = jnp.asarray(candidates, jnp.float32)
    ok = cands <= 1.1 * busy
    return jnp.where(jnp.any(ok), jnp.argmax(ok), len(candidates) - 1).astype(jnp.int32)


def run_with_slots(fn, lengths, slots, candidates, *args, **kwargs):
    """``fn(*args, slots=S, **kwargs)`` with a static ``slots``, or chosen at run time among
    ``candidates`` by :func:`choose_slots` (one compiled branch each)."""
    mesh, axes = _vma.explicit_batch_axes(lengths)
    if mesh is not None:
        spec = ", ".join(repr(a) for a in axes)
        raise ValueError(
            f"the batch of depths is sharded over the mesh axes ({spec}) under plain jax.jit: "
            "dyndepth's per-sample scheduler runs per device, inside jax.shard_map. Call the "
            f"loop inside jax.shard_map(..., in_specs=P({spec}), out_specs=P({spec})) with the "
            "batch split over those axes (README, 'Scaling out')."
        )
    B = lengths.shape[0]

    def call(c):
        if c >= B:
            # One slot per sample: nothing to refill, so the plain batched loop (the same work
            # and the same residuals) without the scheduler's per-slot bookkeeping.
            if fn is forward_scheduled:
                return forward_batched(*args, store=kwargs["store"])
            if fn is backward_scheduled:
                return backward_batched(*args, per_row=kwargs.get("per_row", False))
        return fn(*args, slots=c, **kwargs)

    if slots is not None or len(candidates) == 1:
        return call(slots or candidates[0])

    def branch(c):
        return lambda: call(c)

    branches = [branch(c) for c in candidates]
    return _vma.switch(choose_slots(lengths, candidates), branches)


def _rows(arr, idx):
    return jnp.take(arr, idx, axis=0, mode="clip")


def _cells(arr, idx, pos):
    """``arr[idx[s], pos[s]]`` for a (B, T, ...) array."""
    return arr[jnp.clip(idx, 0, arr.shape[0] - 1), jnp.clip(pos, 0, arr.shape[1] - 1)]


def _drop_idx(mask, idx, B):
    """Row index for a masked scatter: rows where ``mask`` is false go out of range (dropped)."""
    return jnp.where(mask, idx, B)


def _order(has_work, length, by_length):
    key = jnp.where(has_work, length if by_length else 0, -1)
    return jnp.argsort(-key, stable=True).astype(jnp.int32)


def _next_samples(done, ptr, order, num_work):
    """The pending samples that the freed slots (``done``) take, in order: ``(take, index)``."""
    nxt = ptr + jnp.cumsum(done.astype(jnp.int32)) - 1
    return done & (nxt < num_work), _rows(order, nxt)


def forward_scheduled(
    prob: Problem, consts, c_axes, cconsts, cc_axes, init, xs, n, kd, *, store, slots, by_length
):
    """Scheduled counterpart of :func:`dyndepth._engine.forward_batched` (same outputs)."""
    B = n.shape[0]
    S = max(1, min(slots, B))
    T = prob.max_steps
    vstep = prob.vstep(c_axes)
    has = n > 0
    if prob.cond is not None:
        has = has & prob.vcond(cc_axes)(cconsts, init)
    order = _order(has, n, by_length)
    num_work = jnp.sum(has.astype(jnp.int32))

    def per_slot(leaves, axes, idx):
        return [_rows(c, idx) if ax == 0 else c for c, ax in zip(leaves, axes, strict=True)]

    def slot_cond(s_idx, carry):
        act = jnp.ones(s_idx.shape, bool)
        if prob.cond is not None:
            act = prob.vcond(cc_axes)(per_slot(cconsts, cc_axes, s_idx), carry)
        return act

    s_idx = order[:S]
    state = dict(
        s_idx=s_idx,
        s_i=jnp.zeros((S,), jnp.int32),
        s_live=jnp.arange(S) < num_work,
        s_c=[_rows(c, s_idx) for c in init],
        ptr=jnp.asarray(S, jnp.int32),
        iters=jnp.zeros((), jnp.int32),
        out=list(init),
        steps=jnp.zeros((B,), jnp.int32),
        ys=[_vma.zeros((B, T), a) for a in prob.y_avals],
    )
    if store:
        K = prob.slots
        buf = [_vma.zeros((B, K), a) for a in prob.carry_avals]
        state["buf"] = [b.at[:, 0].set(c) for b, c in zip(buf, init, strict=True)]
        state["count"] = jnp.zeros((B,), jnp.int32)
        state["stride"] = jnp.ones((B,), jnp.int32)

    def body(s):
        s = dict(s)
        idx, i, live, carry = s["s_idx"], s["s_i"], s["s_live"], s["s_c"]
        drop = _drop_idx(live, idx, B)
        if store:
            s.update(_store_scheduled(prob, s, idx, i, live, carry, drop))
        x = [_cells(a, idx, i) for a in xs]
        key = prob.key_at(None if kd is None else _rows(kd, idx), i)
        new_c, y = vstep(per_slot(consts, c_axes, idx), carry, x, key)
        s["ys"] = [a.at[drop, i].set(v, mode="drop") for a, v in zip(s["ys"], y, strict=True)]
        carry = where_b(live, list(new_c), carry)
        i = i + live.astype(jnp.int32)
        done = live & ((i >= _rows(n, idx)) | ~slot_cond(idx, carry))
        d_drop = _drop_idx(done, idx, B)
        s["out"] = [o.at[d_drop].set(c, mode="drop") for o, c in zip(s["out"], carry, strict=True)]
        s["steps"] = s["steps"].at[d_drop].set(i, mode="drop")
        # Refill the freed slots with the next pending samples, in order.
        take_new, new_idx = _next_samples(done, s["ptr"], order, num_work)
        s["s_idx"] = jnp.where(take_new, new_idx, idx)
        s["s_i"] = jnp.where(take_new, 0, i)
        s["s_c"] = where_b(take_new, [_rows(c, new_idx) for c in init], carry)
        s["s_live"] = jnp.where(done, take_new, live)
        s["ptr"] = s["ptr"] + jnp.sum(done.astype(jnp.int32))
        s["iters"] = s["iters"] + 1
        return s

    out = _vma.while_loop(lambda s: jnp.any(s["s_live"]), body, state)
    res = (out["buf"], out["stride"]) if store else None
    return out["out"], out["ys"], out["steps"], res, stats_of(out["iters"], S)


def _store_scheduled(prob, s, idx, i, live, carry, drop):
    buf, count, stride = s["buf"], s["count"], s["stride"]
    cnt, st = _rows(count, idx), _rows(stride, idx)
    if prob.thinning:
        K = prob.slots
        full = live & (i % st == 0) & (cnt == K)

        def compact(args):
            buf, count, stride = args
            kept = (K + 1) // 2
            f_drop = _drop_idx(full, idx, buf[0].shape[0])

            def thin(b):
                rows = _rows(b, idx)
                half = rows[:, 0::2]
                pad = jnp.zeros((rows.shape[0], K - kept) + rows.shape[2:], rows.dtype)
                return b.at[f_drop].set(jnp.concatenate([half, pad], axis=1), mode="drop")

            buf = [thin(b) for b in buf]
            count = count.at[f_drop].set(kept, mode="drop")
            stride = stride.at[f_drop].set(st * 2, mode="drop")
            return buf, count, stride

        buf, count, stride = _vma.cond(jnp.any(full), compact, lambda a: a, (buf, count, stride))
        cnt, st = _rows(count, idx), _rows(stride, idx)
    want = live & (i % st == 0)
    w_drop = _drop_idx(want, idx, count.shape[0])
    buf = [b.at[w_drop, cnt].set(c, mode="drop") for b, c in zip(buf, carry, strict=True)]
    count = count.at[w_drop].add(1, mode="drop")
    del drop
    return dict(buf=buf, count=count, stride=stride)


def backward_scheduled(
    prob: Problem, consts, c_axes, xs, kd, res, steps, ct_carry, ct_ys, *, slots, per_row=False
):
    """Scheduled counterpart of :func:`dyndepth._engine.backward_batched` for stored carries
    (no thinning): each slot runs one sample's reverse sweep from its last step down to 0."""
    assert not prob.thinning
    buf, _ = res
    B = steps.shape[0]
    S = max(1, min(slots, B))
    xmask = prob.x_mask
    kmask = [is_diff(c) for c in consts]
    d_axes = take(c_axes, kmask)
    has = steps > 0
    order = _order(has, steps, True)
    num_work = jnp.sum(has.astype(jnp.int32))

    def per_slot(leaves, axes, idx):
        return [_rows(c, idx) if ax == 0 else c for c, ax in zip(leaves, axes, strict=True)]

    s_idx = order[:S]
    xs_d = take(xs, xmask)
    state = dict(
        s_idx=s_idx,
        s_p=_rows(steps, s_idx) - 1,
        s_live=jnp.arange(S) < num_work,
        s_ct=[_rows(c, s_idx) for c in ct_carry],
        ptr=jnp.asarray(S, jnp.int32),
        acc=acc_shapes(consts, c_axes, B, per_row),
        ct_init=list(ct_carry),
        ct_xs=[jnp.zeros_like(a) for a in xs_d],
    )

    def body(s):
        s = dict(s)
        idx, p, live, ct = s["s_idx"], s["s_p"], s["s_live"], s["s_ct"]
        carry = [_cells(b, idx, p) for b in buf]
        x = [_cells(a, idx, p) for a in xs]
        ct_y = [_cells(a, idx, p) for a in ct_ys]
        key = prob.key_at(None if kd is None else _rows(kd, idx), p)
        g_k, g_c, g_x = rows_vjp(
            prob,
            per_slot(consts, c_axes, idx),
            c_axes,
            carry,
            x,
            key,
            ct,
            ct_y,
            live,
            per_row=per_row,
        )
        drop = _drop_idx(live, idx, B)
        s["acc"] = [
            a.at[drop].add(g, mode="drop") if (ax == 0 or per_row) else a + g
            for a, g, ax in zip(s["acc"], g_k, d_axes, strict=True)
        ]
        s["ct_xs"] = [
            a.at[drop, p].set(g, mode="drop") for a, g in zip(s["ct_xs"], g_x, strict=True)
        ]
        ct = where_b(live, list(g_c), ct)
        p = p - live.astype(jnp.int32)
        done = live & (p < 0)
        d_drop = _drop_idx(done, idx, B)
        s["ct_init"] = [
            o.at[d_drop].set(c, mode="drop") for o, c in zip(s["ct_init"], ct, strict=True)
        ]
        take_new, new_idx = _next_samples(done, s["ptr"], order, num_work)
        s["s_idx"] = jnp.where(take_new, new_idx, idx)
        s["s_p"] = jnp.where(take_new, _rows(steps, new_idx) - 1, p)
        s["s_ct"] = where_b(take_new, [_rows(c, new_idx) for c in ct_carry], ct)
        s["s_live"] = jnp.where(done, take_new, live)
        s["ptr"] = s["ptr"] + jnp.sum(done.astype(jnp.int32))
        return s

    out = _vma.while_loop(lambda s: jnp.any(s["s_live"]), body, state)
    return out["acc"], out["ct_init"], out["ct_xs"]
