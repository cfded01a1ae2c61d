"""Per-sample scheduling: every row of a loop step is a sample's step, forward and backward.

A batch of ``B`` samples with per-sample step counts runs in ``S <= B`` *slots* (static shapes);
every loop iteration applies the step to all slots at once, so the work is ``S x iterations``
sample-steps.

**Known step counts** (``repeat``, ``scan``: the depths; every backward pass: the steps taken)
use McNaughton's wrap-around rule. The samples' steps are laid end to end, ``W = sum(steps)``
positions, and cut into ``S`` slots of ``C = max(max(steps), ceil(W / S))`` iterations each:
slot ``s`` runs positions ``[s C, (s + 1) C)``. A sample cut by a slot boundary runs its first
steps at the start of the next slot and its last steps at the end of its own (``steps <= C``,
so the first part ends before the second starts; its carry waits in between). With
``S <= W / max(steps)``, ``C = ceil(W / S)`` and the slots are busy at every iteration but the
last: executed sample-steps are below ``W + S``, whatever the distribution of steps. ``S`` is
chosen at run time among a ladder of slot counts (one compiled branch each) by the time model of
:mod:`dyndepth._cost`: the count of least ``C x (fixed + S x row)``, an iteration's fixed cost
against its rows (:func:`choose_by_time`); ``slots="work"`` takes instead the largest count that
executes at most ``W / 16`` steps more than ``W`` (:func:`choose_by_work`).

**Stopping steps known only when a sample stops** (``while_loop``'s forward pass): continuous
batching; a slot takes the next pending sample the moment its sample stops.

Every sample is stepped with its own keys (``step_key(key_b, i)`` for its step ``i``), xs and
per-sample parameters, so results equal the unscheduled loop's. All of it is one
``lax.while_loop`` with static shapes and no host round-trips.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from . import _cost, _sharding, _vma
from ._batched import const_accumulators, rows_vjp, stats_of, store_state
from ._budget import nbytes
from ._derivative import Perturbed
from ._leaves import where_rows
from ._step import Loop

# Each slot count is one compiled copy of the step (forward and backward), so the ladders are
# short: at most MAX_COUNTS counts. The time rule's ladder is ``B``, ``B / 2``, ``B / 4``, ``B / 8``
# (where the best count of common distributions lies: about ``sum / max`` or just below, ``B / 2``
# for uniform depths, ``B / 3`` for a long tail), then a ratio of 4; no count below
# ``fixed_rows / 8`` (an iteration's fixed cost in rows: a count that runs the same iterations
# with up to that many more rows costs within 1 / 8 of it).
MAX_COUNTS = 5
LADDER_RATIO = 8
# The work rule takes a slot count when it executes at most this fraction more than the useful
# steps.
WORK_SLACK = 1 / 16


def slot_candidates(batch: int, fixed_rows: float) -> tuple[int, ...]:
    """The slot counts that ``slots=None`` chooses from at run time (by :func:`choose_by_time`,
    one compiled branch each), descending, as the comment above says; batches of 2 or fewer
    run unscheduled."""
    if batch <= 2:
        return (batch,)
    smallest = max(1, math.floor(fixed_rows / 8))
    counts, c = [batch], batch
    while c > 1 and len(counts) < MAX_COUNTS:
        c = math.ceil(c / (2 if len(counts) < 4 else 4))
        if c < smallest:
            break
        counts.append(c)
    return tuple(counts)


def work_candidates(batch: int) -> tuple[int, ...]:
    """The slot counts that ``slots="work"`` chooses from (by :func:`choose_by_work`),
    descending: ``B``, ``B / 2``, ``B / 16``, ``B / 128``, ... (rounded up), then 1; batches
    of 2 or fewer run unscheduled."""
    if batch <= 2:
        return (batch,)
    out, c = [batch], math.ceil(batch / 2)
    while c > 1:
        out.append(c)
        c = math.ceil(c / LADDER_RATIO)
    return tuple(out) + (1,)


@dataclasses.dataclass(frozen=True)
class SlotRule:
    """How a batch of ``B`` rows picks its slot count at run time: among ``candidates``
    (descending), the one :func:`choose_by_time` (``fixed_rows`` given) or, for
    ``slots="work"`` (``fixed_rows`` None), :func:`choose_by_work` picks."""

    candidates: tuple[int, ...]
    fixed_rows: float | None

    @staticmethod
    def of(slots: int | tuple[int, ...] | str | None, batch: int, fixed_rows: float) -> SlotRule:
        """The rule of a loop's ``slots`` argument: the time rule on the default ladder, one
        count, or the given counts (those of ``batch`` or more all mean the lockstep batch);
        ``"work"``: the work rule on its ladder."""
        if slots == "work":
            return SlotRule(work_candidates(batch), None)
        if slots is None:
            return SlotRule(slot_candidates(batch, fixed_rows), fixed_rows)
        counts = (slots,) if isinstance(slots, int) else slots
        return SlotRule(tuple(sorted({min(c, batch) for c in counts}, reverse=True)), fixed_rows)

    @staticmethod
    def for_loop(loop: Loop, batch: int, consts, c_axes) -> SlotRule:
        """The rule of ``loop`` over ``batch`` rows, its step's fixed cost in rows read from the
        default backend's costs (``consts`` with axis ``None`` in ``c_axes``: the weights every
        iteration reads once)."""
        return SlotRule.of(loop.slots, batch, fixed_rows(loop, consts, c_axes))

    def choose(self, lengths: jax.Array) -> jax.Array:
        if self.fixed_rows is None:
            return choose_by_work(lengths, self.candidates)
        return choose_by_time(lengths, self.candidates, self.fixed_rows)


def fixed_rows(loop: Loop, consts, c_axes) -> float:
    """An iteration's fixed cost in rows of ``loop``'s step on the default backend, the step's
    consts shared by the rows (axis ``None``) read once per iteration."""
    shared = nbytes([c for c, ax in zip(consts, c_axes, strict=True) if ax is None])
    return _cost.backend_cost().fixed_rows(_cost.jaxpr_flops(loop.step_jaxpr.jaxpr), shared)


def refill_slots(slots: int | tuple[int, ...] | str | None, batch: int, fixed_rows: float) -> int:
    """The slot count of continuous batching (stopping steps unknown up front): ``slots``, the
    largest of several; by default a quarter of the batch, or the whole batch (a lockstep loop
    that ends with its last sample) where an iteration's fixed cost outweighs a quarter of its
    rows: refilling slots then costs more in iterations than it saves in rows."""
    if isinstance(slots, int):
        return slots
    if isinstance(slots, tuple):
        return slots[0]
    if slots is None and fixed_rows >= batch / 4:
        return batch
    return math.ceil(batch / 4)


def iterations(total: jax.Array, longest: jax.Array, slots: int) -> jax.Array:
    """``C``, the iterations of the wrap-around schedule in ``slots`` slots: enough for the
    ``total`` steps, and no fewer than the ``longest`` sample's (its steps run in order)."""
    return jnp.maximum(longest, -(-total // slots))


def executed_steps(lengths: jax.Array, slots: int) -> jax.Array:
    """Sample-steps the wrap-around schedule executes with ``slots`` slots: ``slots x C``."""
    return slots * iterations(jnp.sum(lengths), jnp.max(lengths), slots)


def modeled_time(total: jax.Array, longest: jax.Array, slots: int, fixed_rows: float):
    """The time model of :mod:`dyndepth._cost` in row-steps: ``C x (fixed_rows + slots)``."""
    return iterations(total, longest, slots).astype(jnp.float32) * (fixed_rows + slots)


def choose_by_time(lengths: jax.Array, candidates: tuple[int, ...], fixed_rows: float):
    """Index into ``candidates`` (descending) of the slot count of least modeled time (the
    first, so the most slots, among equals)."""
    lengths = lengths.astype(jnp.int32)
    total, longest = jnp.sum(lengths), jnp.max(lengths)
    times = jnp.stack([modeled_time(total, longest, c, fixed_rows) for c in candidates])
    return jnp.argmin(times).astype(jnp.int32)


def choose_by_work(lengths: jax.Array, candidates: tuple[int, ...]) -> jax.Array:
    """Index into ``candidates`` (descending) of the largest slot count that executes at most
    ``(1 + WORK_SLACK) x sum(lengths)`` sample-steps, else of the one that executes fewest.
    The largest such count runs the fewest iterations; 1 slot always executes exactly the sum,
    so the work bound holds for every distribution of lengths."""
    lengths = lengths.astype(jnp.int32)
    total = jnp.sum(lengths)
    work = jnp.stack([executed_steps(lengths, c) for c in candidates])
    ok = work.astype(jnp.float32) <= (1 + WORK_SLACK) * total.astype(jnp.float32)
    return jnp.where(jnp.any(ok), jnp.argmax(ok), jnp.argmin(work)).astype(jnp.int32)


def run_with_slots(lengths, rule: SlotRule, lockstep, wrapped):
    """``wrapped(queue, S)`` with the slot count ``S`` chosen at run time among the
    ``rule``'s candidates (one compiled branch each; none with one candidate); ``S >= B``
    runs ``lockstep()``: with one slot per sample there is nothing to schedule. The part of
    the layout that does not depend on ``S`` (``queue``) is computed once, outside the
    branches."""
    B = lengths.shape[0]
    queue = Queue.of(lengths)

    def call(c):
        return lockstep() if c >= B else wrapped(queue, c)

    if len(rule.candidates) == 1:
        return call(rule.candidates[0])
    branches = [lambda c=c: call(c) for c in rule.candidates]
    return _vma.switch(rule.choose(lengths), branches)


# ----------------------------------------------------------------------------- wrap-around


@dataclasses.dataclass(frozen=True)
class Queue:
    """``B`` samples of known ``length`` laid end to end: sample ``b`` at positions
    ``[start[b], start[b] + length[b])`` of ``total``; ``after[b]`` is the next sample with
    steps (``B`` when none). The part of a wrap-around layout shared by every slot count."""

    total: jax.Array
    longest: jax.Array
    length: jax.Array
    start: jax.Array
    after: jax.Array

    @staticmethod
    def of(length: jax.Array) -> Queue:
        B = length.shape[0]
        length = length.astype(jnp.int32)
        has = jnp.where(length > 0, jnp.arange(B, dtype=jnp.int32), B)
        after = jnp.concatenate([jax.lax.cummin(has[::-1])[::-1][1:], jnp.full((1,), B, jnp.int32)])
        start = jnp.cumsum(length) - length
        return Queue(jnp.sum(length), jnp.max(length, initial=0), length, start, after)


@dataclasses.dataclass(frozen=True)
class Wrap:
    """The wrap-around layout of a :class:`Queue` in ``S`` slots: ``C`` iterations; a sample
    cut by a slot boundary keeps its first ``head[b]`` positions in its own slot (they run its
    last steps) and runs its first ``length[b] - head[b]`` steps at the start of the next
    slot; ``first[s]`` is slot ``s``'s first sample."""

    C: jax.Array
    total: jax.Array
    length: jax.Array
    start: jax.Array
    head: jax.Array
    after: jax.Array
    first: jax.Array

    @staticmethod
    def of(queue: Queue, S: int) -> Wrap:
        length, start, total = queue.length, queue.start, queue.total
        C = iterations(total, queue.longest, S)
        end = start + length
        cut = (start // jnp.maximum(C, 1) + 1) * C
        head = jnp.where(end > cut, cut - start, length)
        # The sample holding each slot's first position: the count of samples ending at or
        # before it (a comparison of S x B, cheaper to trace and run than a search).
        first = jnp.sum(end[None, :] <= (jnp.arange(S) * C)[:, None], axis=1, dtype=jnp.int32)
        return Wrap(C, total, length, start, head, queue.after, first)

    def at(self, b: jax.Array, t: jax.Array, S: int):
        """For slot sample ``b`` at iteration ``t``: ``(step, starts, ends, live)``: the step of
        the sample it runs, whether its piece starts or ends here, whether the slot is busy."""
        g = jnp.arange(S) * self.C + t
        live = g < self.total
        bc = jnp.minimum(b, self.length.shape[0] - 1)
        length, head = self.length[bc], self.head[bc]
        u = g - self.start[bc]
        step = jnp.where(u >= head, u - head, u + length - head)
        starts = (u == 0) | (t == 0)
        ends = (u == length - 1) | (t == self.C - 1)
        return step, starts, ends, live

    def undone(self, b: jax.Array, r: jax.Array) -> jax.Array:
        """The forward step that reverse step ``r`` of slot sample ``b`` undoes (the same
        gather as :meth:`at`'s, which the compiler merges)."""
        return self.length[jnp.minimum(b, self.length.shape[0] - 1)] - 1 - r


def _hand_over(wrap: Wrap, s: dict, slot_key: str, new: list, live, ends) -> dict:
    """The end of one wrap-around iteration, forward or backward: each slot keeps its new
    values under ``slot_key``; a slot whose piece ends writes them out to its sample's row of
    ``cur`` and moves on to the next sample with steps."""
    b, t = s["b"], s["t"]
    out = _drop_idx(live & ends, b, wrap.length.shape[0])
    cur = [o.at[out].set(c, mode="drop") for o, c in zip(s["cur"], new, strict=True)]
    nxt = jnp.where(live & ends & (t < wrap.C - 1), _rows(wrap.after, b), b)
    return {"cur": cur, slot_key: list(new), "b": nxt, "t": t + 1}


def forward_wrapped(loop: Loop, consts, c_axes, cconsts, cc_axes, init, xs, n, kd, *, store,
                    slots, queue):  # fmt: skip
    """:func:`dyndepth._batched.forward` on the wrap-around schedule (same outputs; no stop
    predicate: the steps are the depths); ``queue`` is ``Queue.of(n)``."""
    del cconsts, cc_axes
    B = n.shape[0]
    S = max(1, min(slots, B))
    T = loop.max_steps
    wrap = Wrap.of(queue, S)
    vstep = loop.vstep(c_axes, S)
    state = dict(
        t=jnp.zeros((), jnp.int32),
        b=wrap.first,
        c=[_rows(c, wrap.first) for c in init],
        cur=list(init),
        ys=[_sharding.zeros((B, T), a) for a in loop.y_avals],
    )
    if store:
        state.update(store_state(loop, init, B))

    def body(s):
        s = dict(s)
        b, t = s["b"], s["t"]
        i, starts, ends, live = wrap.at(b, t, S)
        carry = where_rows(starts, [_rows(c, b) for c in s["cur"]], s["c"])
        if store:
            s.update(_store_scheduled(loop, s, b, i, live, carry))
        key = loop.key_at(None if kd is None else _rows(kd, b), i)
        new_c, y = vstep(_per_slot(consts, c_axes, b), carry, [_cells(a, b, i) for a in xs], key)
        drop = _drop_idx(live, b, B)
        s["ys"] = [a.at[drop, i].set(v, mode="drop") for a, v in zip(s["ys"], y, strict=True)]
        s.update(_hand_over(wrap, s, "c", new_c, live, ends))
        return s

    out = _vma.while_loop(lambda s: s["t"] < wrap.C, body, state)
    res = (out["buf"], out["stride"]) if store else None
    return out["cur"], out["ys"], n, res, stats_of(wrap.C, S)


def backward_wrapped(loop: Loop, pert: Perturbed, consts, c_axes, xs, kd, res, steps, ct_carry,
                     ct_ys, *, slots, per_row, queue):  # fmt: skip
    """:func:`dyndepth._batched.backward` (stored carries, no thinning) on the wrap-around
    schedule: each sample's reverse sweep, its steps in reverse order, laid end to end;
    ``queue`` is ``Queue.of(steps)``."""
    assert not loop.thinning
    buf, _ = res
    B = steps.shape[0]
    S = max(1, min(slots, B))
    wrap = Wrap.of(queue, S)
    d_axes = [ax for ax, p in zip(c_axes, pert.consts, strict=True) if p]
    state = dict(
        t=jnp.zeros((), jnp.int32),
        b=wrap.first,
        ct=[_rows(c, wrap.first) for c in ct_carry],
        cur=list(ct_carry),
        acc=const_accumulators(pert, consts, c_axes, B, per_row),
        ct_xs=[jnp.zeros_like(a) for a, p in zip(xs, pert.xs, strict=True) if p],
    )

    def body(s):
        s = dict(s)
        b, t = s["b"], s["t"]
        r, starts, ends, live = wrap.at(b, t, S)
        j = wrap.undone(b, r)
        ct = where_rows(starts, [_rows(c, b) for c in s["cur"]], s["ct"])
        key = loop.key_at(None if kd is None else _rows(kd, b), j)
        g_k, g_c, g_x = rows_vjp(
            loop, pert, _per_slot(consts, c_axes, b), c_axes, [_cells(c, b, j) for c in buf],
            [_cells(a, b, j) for a in xs], key, ct, [_cells(a, b, j) for a in ct_ys], live,
            per_row=per_row,
        )  # fmt: skip
        drop = _drop_idx(live, b, B)
        s["acc"] = [a.at[drop].add(g, mode="drop") if (ax == 0 or per_row) else a + g
                    for a, g, ax in zip(s["acc"], g_k, d_axes, strict=True)]  # fmt: skip
        s["ct_xs"] = [a.at[drop, j].set(g, mode="drop")
                      for a, g in zip(s["ct_xs"], g_x, strict=True)]  # fmt: skip
        s.update(_hand_over(wrap, s, "ct", g_c, live, ends))
        return s

    out = _vma.while_loop(lambda s: s["t"] < wrap.C, body, state)
    return out["acc"], out["cur"], out["ct_xs"]


# ----------------------------------------------------------------------------- refill


def _rows(arr, idx):
    return jnp.take(arr, idx, axis=0, mode="clip")


def _cells(arr, idx, pos):
    """``arr[idx[s], pos[s]]`` for a (B, T, ...) array."""
    return arr[jnp.clip(idx, 0, arr.shape[0] - 1), jnp.clip(pos, 0, arr.shape[1] - 1)]


def _drop_idx(mask, idx, B):
    """Row index for a masked scatter: rows where ``mask`` is false go out of range (dropped)."""
    return jnp.where(mask, idx, B)


def _per_slot(leaves, axes, idx):
    """Each slot's row of the per-sample leaves (axis 0); shared ones (axis None) as they are."""
    return [_rows(c, idx) if ax == 0 else c for c, ax in zip(leaves, axes, strict=True)]


def _next_samples(done, ptr, order, num_work):
    """The pending samples that the freed slots (``done``) take, in order: ``(take, index)``."""
    nxt = ptr + jnp.cumsum(done.astype(jnp.int32)) - 1
    return done & (nxt < num_work), _rows(order, nxt)


def forward_refill(loop: Loop, consts, c_axes, cconsts, cc_axes, init, xs, n, kd, *, store, slots):
    """:func:`dyndepth._batched.forward` with continuous batching, for a loop with a stop
    predicate: samples start in :func:`_queue_order`, and a slot takes the next pending
    sample the moment its sample stops."""
    B = n.shape[0]
    S = max(1, min(slots, B))
    vstep = loop.vstep(c_axes, S)
    has = n > 0
    if loop.cond_jaxpr is not None:
        has = has & loop.vcond(cc_axes, B)(cconsts, init)
    order = _queue_order(loop, cconsts, cc_axes, init, has)
    num_work = jnp.sum(has.astype(jnp.int32))

    def slot_cond(s_idx, carry):
        act = jnp.ones(s_idx.shape, bool)
        if loop.cond_jaxpr is not None:
            act = loop.vcond(cc_axes, S)(_per_slot(cconsts, cc_axes, s_idx), carry)
        return act

    state = _refill_state(loop, init, order, num_work, S, store)

    def body(s):
        s = dict(s)
        idx, i, live, carry = s["s_idx"], s["s_i"], s["s_live"], s["s_c"]
        drop = _drop_idx(live, idx, B)
        if store:
            s.update(_store_scheduled(loop, s, idx, i, live, carry))
        x = [_cells(a, idx, i) for a in xs]
        key = loop.key_at(None if kd is None else _rows(kd, idx), i)
        new_c, y = vstep(_per_slot(consts, c_axes, idx), carry, x, key)
        s["ys"] = [a.at[drop, i].set(v, mode="drop") for a, v in zip(s["ys"], y, strict=True)]
        carry = where_rows(live, list(new_c), carry)
        i = i + live.astype(jnp.int32)
        done = live & ((i >= _rows(n, idx)) | ~slot_cond(idx, carry))
        d_drop = _drop_idx(done, idx, B)
        s["out"] = [o.at[d_drop].set(c, mode="drop") for o, c in zip(s["out"], carry, strict=True)]
        s["steps"] = s["steps"].at[d_drop].set(i, mode="drop")
        # Refill the freed slots with the next pending samples, in order.
        take_new, new_idx = _next_samples(done, s["ptr"], order, num_work)
        s["s_idx"] = jnp.where(take_new, new_idx, idx)
        s["s_i"] = jnp.where(take_new, 0, i)
        s["s_c"] = where_rows(take_new, [_rows(c, new_idx) for c in init], carry)
        s["s_live"] = jnp.where(done, take_new, live)
        s["ptr"] = s["ptr"] + jnp.sum(done.astype(jnp.int32))
        s["iters"] = s["iters"] + 1
        return s

    out = _vma.while_loop(lambda s: jnp.any(s["s_live"]), body, state)
    res = (out["buf"], out["stride"]) if store else None
    return out["out"], out["ys"], out["steps"], res, stats_of(out["iters"], S)


def _queue_order(loop: Loop, cconsts, cc_axes, init, has) -> jax.Array:
    """The order in which samples enter the slots: those with steps to take first, by
    decreasing priority at ``init`` when the loop has one (a NaN counts as the lowest), in
    batch order among equals."""
    B = has.shape[0]
    no_work = jnp.where(has, 0, 1)
    if not loop.priority:
        return jnp.argsort(no_work, stable=True).astype(jnp.int32)
    prio = jax.vmap(loop.start_priority, in_axes=(list(cc_axes), 0), axis_size=B)(cconsts, init)
    # (sorting puts NaNs last, after every number)
    return jnp.lexsort((jnp.arange(B), -prio, no_work)).astype(jnp.int32)


def _refill_state(loop: Loop, init, order, num_work, S: int, store: bool) -> dict:
    """The state of :func:`forward_refill`'s loop before its first iteration: the first ``S``
    samples of ``order`` in the slots (those with work live), the per-sample outputs empty."""
    B, T = order.shape[0], loop.max_steps
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
        ys=[_sharding.zeros((B, T), a) for a in loop.y_avals],
    )
    if store:
        K = loop.slots_stored
        buf = [_sharding.zeros((B, K), a) for a in loop.carry_avals]
        state["buf"] = [b.at[:, 0].set(c) for b, c in zip(buf, init, strict=True)]
        state["count"] = jnp.zeros((B,), jnp.int32)
        state["stride"] = jnp.ones((B,), jnp.int32)
    return state


def _store_scheduled(loop, s, idx, i, live, carry):
    """Store each slot's carry before step ``i`` of its sample ``idx``: in column ``i``, or with
    checkpoint thinning, every ``stride``-th step of the sample (halving the sample's
    checkpoints when its ``K`` slots fill up)."""
    buf, count, stride = s["buf"], s["count"], s["stride"]
    if not loop.thinning:  # every step is stored, so a sample's count is its step
        drop = _drop_idx(live, idx, count.shape[0])
        return dict(
            buf=[b.at[drop, i].set(c, mode="drop") for b, c in zip(buf, carry, strict=True)]
        )
    K = loop.slots_stored
    full = live & (i % _rows(stride, idx) == 0) & (_rows(count, idx) == K)
    buf, count, stride = _vma.cond(
        jnp.any(full), lambda a: _thin(K, idx, full, *a), lambda a: a, (buf, count, stride)
    )
    cnt, st = _rows(count, idx), _rows(stride, idx)
    want = live & (i % st == 0)
    w_drop = _drop_idx(want, idx, count.shape[0])
    buf = [b.at[w_drop, cnt].set(c, mode="drop") for b, c in zip(buf, carry, strict=True)]
    count = count.at[w_drop].add(1, mode="drop")
    return dict(buf=buf, count=count, stride=stride)


def _thin(K, idx, full, buf, count, stride):
    """Samples ``idx`` whose ``K`` checkpoints are ``full`` keep every other one, at twice the
    stride."""
    kept = (K + 1) // 2
    f_drop = _drop_idx(full, idx, buf[0].shape[0])

    def thin(b):
        rows = _rows(b, idx)
        pad = jnp.zeros((rows.shape[0], K - kept) + rows.shape[2:], rows.dtype)
        return b.at[f_drop].set(jnp.concatenate([rows[:, 0::2], pad], axis=1), mode="drop")

    doubled = _rows(stride, idx) * 2
    return (
        [thin(b) for b in buf],
        count.at[f_drop].set(kept, mode="drop"),
        stride.at[f_drop].set(doubled, mode="drop"),
    )
