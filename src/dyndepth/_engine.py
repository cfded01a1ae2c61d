"""The one loop core behind ``repeat``, ``scan`` and ``while_loop``.

A *problem* is a step ``(consts, carry, x, key) -> (carry, y)`` over flat lists of leaves, an
optional stop predicate ``(cconsts, carry) -> bool``, a static ``max_steps`` and a checkpoint
budget. Step ``i`` of a sample runs while ``i < n`` and the predicate holds; the loop stops at the
first step that does not run.

Everything here works on an explicit batch axis ``B`` (an unbatched call is a batch of one), so
that the same code serves a single loop, the ``custom_vmap`` rules and the scheduler. Closed-over
parameters ("consts") carry an axis spec: ``None`` (shared by the batch: never broadcast) or
``0`` (one per sample).

Strategies:

* ``masked``: ``lax.scan`` over ``max_steps`` with ``lax.cond`` (the seed's method).
* ``while``: a ``lax.while_loop``; a ``custom_jvp`` gives forward mode, and a guard makes reverse
  mode fail with a message that points to ``"checkpointed"``.
* ``checkpointed``: a ``custom_vjp`` whose forward is a while loop that stores checkpoints and
  whose backward is a while loop over the steps taken, in reverse. The forward and the backward are
  ``custom_vmap`` functions, so under ``vmap`` shared parameters stay shared and their gradient is
  summed inside the loop instead of being broadcast to the batch.

  Unbatched (no ``vmap``) and with no checkpoint thinning, the loops run without a batch axis
  (:func:`forward_single`, :func:`backward_single`). The forward loop stores each step's
  *residuals* (what the step's own vjp needs, parameters referenced instead of copied) and the
  backward loop applies the step's pullback without recomputing the step, as ``lax.scan`` does
  (outside ``shard_map``, when the residuals fit :data:`RESIDUAL_BUDGET`); otherwise it stores
  the carry and the backward loop recomputes each step once.

Under ``jit`` with the batch a ``custom_vmap`` rule sees (or ``run_batch``'s) sharded over
``Explicit`` mesh axes, the batched loops run inside a ``shard_map`` over those axes, one per
device on its shard (:func:`dyndepth._vma.per_device`); the loop buffers take the types
(shardings) of the values written into them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_batching import custom_vmap
from jax.custom_derivatives import linear_call

from . import _vma
from ._keys import KeySchedule

Leaves = list[Any]


# ----------------------------------------------------------------------------- small helpers


def is_diff(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def take(leaves: Sequence[Any], mask: Sequence[bool], want: bool = True) -> Leaves:
    return [leaf for leaf, m in zip(leaves, mask, strict=True) if m == want]


def merge(diff: Sequence[Any], nondiff: Sequence[Any], mask: Sequence[bool]) -> Leaves:
    d, n = iter(diff), iter(nondiff)
    return [next(d) if m else next(n) for m in mask]


def bcast(mask: jax.Array, x: jax.Array) -> jax.Array:
    """Broadcast a (B,) mask against a (B, ...) array."""
    return mask.reshape(mask.shape + (1,) * (x.ndim - 1))


def where_b(mask: jax.Array, new: Leaves, old: Leaves) -> Leaves:
    return [jnp.where(bcast(mask, a), a, b) for a, b in zip(new, old, strict=True)]


def gather_rows(bufs: Leaves, idx: jax.Array) -> Leaves:
    """``buf[b, idx[b]]`` for every (B, T, ...) buffer; the index is clamped into range."""
    return [
        jax.vmap(lambda a, i: lax.dynamic_index_in_dim(a, i, 0, keepdims=False))(buf, idx)
        for buf in bufs
    ]


def scatter_rows(bufs: Leaves, idx: jax.Array, vals: Leaves, mask: jax.Array) -> Leaves:
    """``buf[b, idx[b]] = val[b]`` where ``mask[b]``; other rows keep their contents."""

    def one(buf, i, v, m):
        old = lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)
        return lax.dynamic_update_index_in_dim(buf, jnp.where(m, v, old), i, 0)

    return [jax.vmap(one)(buf, idx, v, mask) for buf, v in zip(bufs, vals, strict=True)]


def zeros_like_leaves(leaves: Sequence[Any]) -> Leaves:
    return [jnp.zeros(x.shape, x.dtype) for x in leaves]


# ----------------------------------------------------------------------------- the problem


@dataclasses.dataclass(frozen=True, eq=False)
class Problem:
    """Static description of one loop; see the module docstring."""

    step: Callable[[Leaves, Leaves, Leaves, Any], tuple[Leaves, Leaves]]
    cond: Callable[[Leaves, Leaves], jax.Array] | None
    carry_avals: tuple[jax.ShapeDtypeStruct, ...]
    x_avals: tuple[jax.ShapeDtypeStruct, ...]
    y_avals: tuple[jax.ShapeDtypeStruct, ...]
    max_steps: int
    checkpoints: int | None
    keys: KeySchedule | None
    schedule: bool = False
    sched_slots: int | None = None
    # ``step`` slices its first ``stacked`` consts at ``x[0]`` (a layer index) along axis 0 and
    # hands the slices to ``inner``; the stored-residual path differentiates with respect to the
    # slices, so that a layer's parameters are neither stored nor given a stack-size gradient
    # at every step.
    stacked: int = 0
    inner: Callable[[Leaves, Leaves, Leaves, Any], tuple[Leaves, Leaves]] | None = None

    @property
    def slots(self) -> int:
        """Checkpoint slots stored by the forward pass."""
        if self.checkpoints is None or self.checkpoints >= self.max_steps:
            return max(self.max_steps, 1)
        return self.checkpoints

    @property
    def thinning(self) -> bool:
        return self.slots < self.max_steps

    @property
    def segment(self) -> int:
        """Largest checkpoint spacing: the size of the backward pass's recompute buffer."""
        if not self.thinning:
            return 1
        s = 1
        while math.ceil(self.max_steps / s) > self.slots:
            s *= 2
        return s

    @property
    def carry_mask(self) -> list[bool]:
        return [is_diff(a) for a in self.carry_avals]

    @property
    def x_mask(self) -> list[bool]:
        return [is_diff(a) for a in self.x_avals]

    @property
    def y_mask(self) -> list[bool]:
        return [is_diff(a) for a in self.y_avals]

    def key_at(self, kd: Any, i: jax.Array) -> Any:
        if self.keys is None:
            return None
        return jax.vmap(self.keys.key_at)(kd, i)

    def vstep(self, c_axes: Sequence[int | None]) -> Callable:
        return jax.vmap(self.step, in_axes=(list(c_axes), 0, 0, 0))

    def vcond(self, cc_axes: Sequence[int | None]) -> Callable:
        assert self.cond is not None
        return jax.vmap(self.cond, in_axes=(list(cc_axes), 0))


def _active(prob, cconsts, cc_axes, i, n, carry):
    act = i < n
    if prob.cond is not None:
        act = act & prob.vcond(cc_axes)(cconsts, carry)
    return act


# ----------------------------------------------------------------------------- forward


def forward_batched(prob: Problem, consts, c_axes, cconsts, cc_axes, init, xs, n, kd, *, store):
    """Run the loop on a batch. Returns ``(carry, ys, steps)`` and, with ``store``, the residuals
    ``(buf, stride)``: ``buf[b, j]`` is the carry before step ``j * stride[b]``."""
    B = n.shape[0]
    T = prob.max_steps
    vstep = prob.vstep(c_axes)
    ys0 = [_vma.zeros((B, T), a) for a in prob.y_avals]
    i0 = jnp.zeros((B,), jnp.int32)
    act0 = _active(prob, cconsts, cc_axes, i0, n, init)
    state = dict(i=i0, act=act0, carry=list(init), ys=ys0)
    if store:
        K = prob.slots
        state["buf"] = [_vma.zeros((B, K), a) for a in prob.carry_avals]
        # Slot 0 always holds init, so that the backward pass never evaluates the step at an
        # uninitialised state, even for samples that take no step.
        state["buf"] = [b.at[:, 0].set(c) for b, c in zip(state["buf"], init, strict=True)]
        state["count"] = jnp.zeros((B,), jnp.int32)
        state["stride"] = jnp.ones((B,), jnp.int32)

    def body(s):
        i, act, carry = s["i"], s["act"], s["carry"]
        s = dict(s)
        if store:
            s.update(_store(prob, s, i, act, carry))
        x = gather_rows(xs, i)
        new_carry, y = vstep(consts, carry, x, prob.key_at(kd, i))
        s["carry"] = where_b(act, list(new_carry), carry)
        s["ys"] = scatter_rows(s["ys"], i, list(y), act)
        s["i"] = i + act.astype(jnp.int32)
        s["act"] = act & _active(prob, cconsts, cc_axes, s["i"], n, s["carry"])
        return s

    state["iters"] = jnp.zeros((), jnp.int32)

    def counted(s):
        s = body(s)
        s["iters"] = s["iters"] + 1
        return s

    out = _vma.while_loop(lambda s: jnp.any(s["act"]), counted, state)
    res = (out["buf"], out["stride"]) if store else None
    return out["carry"], out["ys"], out["i"], res, stats_of(out["iters"], B)


def merge_stats(per_device):
    """Stats of per-device loops, stacked: the longest loop, the sum of executed steps."""
    return jnp.stack([jnp.max(per_device[:, 0]), jnp.sum(per_device[:, 1])])


def stats_of(iterations, slots):
    """``[loop iterations, executed sample-steps]`` as an int32 vector."""
    return jnp.stack([iterations, iterations * slots]).astype(jnp.int32)


def _store(prob, s, i, act, carry):
    buf, count, stride = s["buf"], s["count"], s["stride"]
    if prob.thinning:
        K = prob.slots
        full = act & (i % stride == 0) & (count == K)

        def compact(args):
            buf, count, stride = args
            kept = (K + 1) // 2

            def thin(b):
                half = b[:, 0::2]
                pad = jnp.zeros((b.shape[0], K - kept) + b.shape[2:], b.dtype)
                return jnp.concatenate([half, pad], axis=1)

            buf = where_b(full, [thin(b) for b in buf], buf)
            count = jnp.where(full, kept, count)
            stride = jnp.where(full, stride * 2, stride)
            return buf, count, stride

        buf, count, stride = _vma.cond(jnp.any(full), compact, lambda a: a, (buf, count, stride))
    want = act & (i % stride == 0)
    buf = scatter_rows(buf, count, carry, want)
    count = count + want.astype(jnp.int32)
    return dict(buf=buf, count=count, stride=stride)


# ----------------------------------------------------------------------------- backward


def rows_vjp(prob: Problem, consts, c_axes, carry, x, key, ct_c, ct_y, act, *, per_row):
    """One step's vjp on a batch of rows; rows where ``act`` is false contribute nothing.

    Returns cotangents ``(g_consts, g_carry, g_x)`` for the differentiable leaves. A const with
    axis 0 gets one cotangent per row. A shared const (axis ``None``) gets the sum over the rows
    (one vjp of the batched step: the cheap form, right for the gradient of a batched function)
    or, with ``per_row``, one cotangent per row (right under ``vmap`` of a per-sample vjp, where
    each sample's gradient of the shared const is its own)."""
    cmask, xmask, ymask = prob.carry_mask, prob.x_mask, prob.y_mask
    kmask = [is_diff(c) for c in consts]
    d_axes = take(c_axes, kmask)
    # Inactive rows (finished samples, idle slots, steps past a short segment) hold carries the
    # loop never reached, where the step's Jacobian may be inf/NaN: with a zero cotangent, 0 * NaN
    # would still poison the shared-parameter sum. They are evaluated at an active row's inputs
    # instead, a point of a genuine trajectory, and their zero cotangent then contributes 0.
    B = act.shape[0]
    if B > 1:
        src = jnp.where(act, jnp.arange(B), jnp.argmax(act))
        carry = [c[src] for c in carry]
        x = [a[src] for a in x]
        key = None if key is None else key[src]
        consts = [c[src] if ax == 0 else c for c, ax in zip(consts, c_axes, strict=True)]
    ct_c = [jnp.where(bcast(act, c), c, 0) for c in ct_c]
    ct_y = [jnp.where(bcast(act, c), c, 0) for c in ct_y]

    def pullback(step, kd_, kn, cd, cn, xd, xn, k, ct_c, ct_y):
        def f(kd_, cd, xd):
            new_c, y = step(merge(kd_, kn, kmask), merge(cd, cn, cmask), merge(xd, xn, xmask), k)
            return take(list(new_c), cmask), take(list(y), ymask)

        return jax.vjp(f, kd_, cd, xd)[1]((ct_c, ct_y))

    # Inside shard_map, a vjp with respect to a replicated value would psum its cotangent over
    # the devices, a collective inside a loop whose trip count differs per device (a deadlock).
    # Varying inputs keep the per-device cotangents local; the caller sums them once at the end.
    args = (
        _vma.vary(take(consts, kmask)),
        take(consts, kmask, False),
        _vma.vary(take(carry, cmask)),
        take(carry, cmask, False),
        _vma.vary(take(x, xmask)),
        take(x, xmask, False),
        key,
        ct_c,
        ct_y,
    )
    if per_row:
        axes = (list(d_axes), list(take(c_axes, kmask, False))) + (0,) * 7
        g_k, g_c, g_x = jax.vmap(lambda *a: pullback(prob.step, *a), in_axes=axes)(*args)
        return [jnp.where(bcast(act, g), g, 0) for g in g_k], g_c, g_x
    g_k, g_c, g_x = pullback(prob.vstep(c_axes), *args)
    any_act = jnp.any(act)
    g_k = [
        jnp.where(bcast(act, g), g, 0) if ax == 0 else jnp.where(any_act, g, 0)
        for g, ax in zip(g_k, d_axes, strict=True)
    ]
    return g_k, g_c, g_x


def acc_shapes(consts, c_axes, B, per_row):
    """Zero accumulators for the const cotangents (see :func:`rows_vjp`)."""
    out = []
    for c, ax in zip(consts, c_axes, strict=True):
        if is_diff(c):
            shape = jnp.shape(c) if (ax == 0 or not per_row) else (B,) + jnp.shape(c)
            out.append(
                jnp.zeros_like(c) if shape == jnp.shape(c) else _vma.zeros((B,), _vma.typed_aval(c))
            )
    return out


def backward_batched(
    prob: Problem, consts, c_axes, xs, kd, res, steps, ct_carry, ct_ys, *, per_row=False
):
    """Reverse sweep. ``ct_carry``/``ct_ys`` hold the differentiable leaves only.

    Returns cotangents for the differentiable leaves of ``consts`` (for shared consts: summed over
    the batch, or per sample with ``per_row``), of ``init`` and of ``xs``."""
    buf, stride = res
    B = steps.shape[0]
    S = prob.segment
    xmask = prob.x_mask
    vstep = prob.vstep(c_axes)
    nseg = (steps + stride - 1) // stride
    rounds = jnp.max(nseg)

    def vjp_step(carry, x, key, ct_c, ct_y, act):
        return rows_vjp(prob, consts, c_axes, carry, x, key, ct_c, ct_y, act, per_row=per_row)

    def reverse_step(s, idx, state_c, act):
        x = gather_rows(xs, idx)
        ct_y = gather_rows(ct_ys, idx)
        g_k, g_c, g_x = vjp_step(state_c, x, prob.key_at(kd, idx), s["ct"], ct_y, act)
        s = dict(s)
        s["acc"] = [a + g for a, g in zip(s["acc"], g_k, strict=True)]
        s["ct"] = where_b(act, g_c, s["ct"])
        s["ct_xs"] = scatter_rows(s["ct_xs"], idx, g_x, act)
        return s

    acc0 = acc_shapes(consts, c_axes, B, per_row)
    ct_xs0 = [jnp.zeros_like(a) for a in take(xs, xmask)]
    state = dict(r=jnp.zeros((), jnp.int32), ct=list(ct_carry), acc=acc0, ct_xs=ct_xs0)

    def segment_body(s):
        j = nseg - 1 - s["r"]
        seg_act = j >= 0
        start = jnp.maximum(j, 0) * stride
        length = jnp.where(seg_act, jnp.minimum(stride, steps - start), 0)
        c0 = gather_rows(buf, jnp.maximum(j, 0))
        if S == 1:
            s = reverse_step(s, start, c0, seg_act)
        else:
            lb0 = [_vma.zeros((B, S), a) for a in prob.carry_avals]
            lb0 = [b.at[:, 0].set(c) for b, c in zip(lb0, c0, strict=True)]
            tmax = jnp.max(length)

            def recompute(rs):
                t, c, lb = rs
                act = t < length
                idx = start + t - 1
                x = gather_rows(xs, idx)
                new_c, _ = vstep(consts, c, x, prob.key_at(kd, idx))
                c = where_b(act, list(new_c), c)
                lb = scatter_rows(lb, jnp.broadcast_to(t, (B,)), c, act)
                return t + 1, c, lb

            _, _, lb = _vma.while_loop(
                lambda rs: rs[0] < tmax, recompute, (jnp.ones((), jnp.int32), c0, lb0)
            )

            def unwind(us):
                t, s = us
                act = t < length
                state_c = gather_rows(lb, jnp.broadcast_to(t, (B,)))
                return t - 1, reverse_step(s, start + t, state_c, act)

            _, s = _vma.while_loop(lambda us: us[0] >= 0, unwind, (tmax - 1, s))
        s = dict(s)
        s["r"] = s["r"] + 1
        return s

    out = _vma.while_loop(lambda s: s["r"] < rounds, segment_body, state)
    return out["acc"], out["ct"], out["ct_xs"]


# ----------------------------------------------------------------------------- stored residuals

# A step's stored residuals may take at most this many times the carry's bytes; beyond it the
# loop stores the carry and recomputes the step in the backward pass (bounded memory).
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


def step_consts(S: int, consts: Leaves, x: Leaves) -> Leaves:
    """The consts one step sees: the first ``S`` (stacked) sliced at the step's layer index
    ``x[0]`` (see ``Problem.stacked``)."""
    if not S:
        return list(consts)
    i = x[0]
    return [lax.dynamic_index_in_dim(c, i, 0, keepdims=False) for c in consts[:S]] + list(
        consts[S:]
    )


def _step_vjp(prob: Problem, consts: Leaves, carry: Leaves, x: Leaves, key: Any):
    """One step and its pullback: ``(new_carry, y), pullback`` for the differentiable leaves of
    ``(consts, carry, x)`` (``consts`` as :func:`step_consts` gives them)."""
    step = prob.inner or prob.step
    kmask = [is_diff(c) for c in consts]
    cmask, xmask, ymask = prob.carry_mask, prob.x_mask, prob.y_mask
    kn, cn, xn = take(consts, kmask, False), take(carry, cmask, False), take(x, xmask, False)

    def f(kd_, cd, xd):
        new_c, y = step(merge(kd_, kn, kmask), merge(cd, cn, cmask), merge(xd, xn, xmask), key)
        out = (take(list(new_c), cmask), take(list(y), ymask))
        return out, (list(new_c), list(y))

    _, pullback, aux = jax.vjp(
        f, take(consts, kmask), take(carry, cmask), take(x, xmask), has_aux=True
    )
    return aux, pullback


def _nbytes(avals) -> int:
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in avals)


def residual_plan(prob: Problem, consts, init, xs, kd) -> ResidualPlan | None:
    """Plan the stored-residual path for an unbatched loop, or ``None`` where it does not apply
    (checkpoint thinning, inside ``shard_map``, or residuals over the budget)."""
    if prob.thinning or _vma.manual_axes():
        return None
    found = {}

    def trace(consts, carry, x, kd):
        key = None if prob.keys is None else prob.keys.key_at(kd, jnp.zeros((), jnp.int32))
        cs = step_consts(prob.stacked, consts, x)
        _, pullback = _step_vjp(prob, cs, carry, x, key)
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
        list(consts),
        list(prob.carry_avals),
        list(xs),
        kd,
    )
    stored = tuple(stored)
    if _nbytes(stored) > RESIDUAL_BUDGET * max(_nbytes(prob.carry_avals), 1):
        return None
    return ResidualPlan(treedef=found["treedef"], sources=found["sources"], stored=stored)


def forward_single(prob: Problem, plan: ResidualPlan | None, consts, cconsts, init, xs, n, kd,
                   *, store: bool):  # fmt: skip
    """The unbatched forward loop, with no batch axis (no ``vmap`` of the step). With ``store``
    it stores, per step, the carry (``buf``) and, with a ``plan``, the pullback's other
    residuals (``ext``). Returns ``(carry, ys, steps, (buf, stride, ext) or None, stats)``."""
    T = prob.max_steps

    def active(i, carry):
        act = i < n
        if prob.cond is not None:
            act = act & prob.cond(cconsts, carry)
        return act

    def put(bufs, i, vals):
        return [
            lax.dynamic_update_index_in_dim(b, v, i, 0) for b, v in zip(bufs, vals, strict=True)
        ]

    i0 = jnp.zeros((), jnp.int32)
    state = dict(
        i=i0,
        act=active(i0, list(init)),
        carry=list(init),
        ys=[_vma.zeros((T,), a) for a in prob.y_avals],
    )
    if store:
        state["buf"] = [_vma.zeros((T,), a) for a in prob.carry_avals]
        state["ext"] = [] if plan is None else [_vma.zeros((T,), a) for a in plan.stored]

    def body(s):
        i, carry = s["i"], s["carry"]
        x = [lax.dynamic_index_in_dim(a, i, 0, keepdims=False) for a in xs]
        key = None if prob.keys is None else prob.keys.key_at(kd, i)
        s = dict(s)
        if plan is None:
            new_c, y = prob.step(consts, carry, x, key)
            if store:
                s["buf"] = put(s["buf"], i, carry)
        else:
            cs = step_consts(prob.stacked, consts, x)
            (new_c, y), pullback = _step_vjp(prob, cs, carry, x, key)
            leaves = jax.tree_util.tree_leaves(pullback)
            stored = [lf for lf, src in zip(leaves, plan.sources, strict=True) if src[0] == "s"]
            s["buf"] = put(s["buf"], i, carry)
            s["ext"] = put(s["ext"], i, stored)
        s["ys"] = put(s["ys"], i, list(y))
        s["carry"] = list(new_c)
        s["i"] = i + 1
        s["act"] = active(s["i"], s["carry"])
        return s

    out = _vma.while_loop(lambda s: s["act"], body, state)
    res = (out["buf"], jnp.ones((), jnp.int32), out["ext"]) if store else None
    return out["carry"], out["ys"], out["i"], res, stats_of(out["i"], 1)


def _pullback_of(plan: ResidualPlan, cs, buf, ext, x, key, at):
    """One step's pullback from its stored and referenced residuals."""
    leaves = []
    for src in plan.sources:
        if src[0] == "k":
            leaves.append(cs[src[1]])
        elif src[0] == "c":
            leaves.append(at(buf[src[1]]))
        elif src[0] == "x":
            leaves.append(x[src[1]])
        elif src[0] == "key":
            leaves.append(key)
        else:
            leaves.append(at(ext[src[1]]))
    return jax.tree_util.tree_unflatten(plan.treedef, leaves)


def backward_single(prob: Problem, plan: ResidualPlan | None, consts, xs, kd, res, steps,
                    ct_carry, ct_ys):  # fmt: skip
    """The reverse sweep of :func:`forward_single`: each step's pullback, rebuilt from its
    stored and referenced residuals without recomputing the step (with a ``plan``), or from
    the step's vjp at the stored carry (without). Returns the cotangents of the differentiable
    consts, of ``init`` and of ``xs`` (as :func:`backward_batched`)."""
    buf, _, ext = res
    S = prob.stacked
    kmask = [is_diff(c) for c in consts]
    xmask = prob.x_mask

    def body(s):
        j = s["j"]
        x = [lax.dynamic_index_in_dim(a, j, 0, keepdims=False) for a in xs]
        cs = step_consts(prob.stacked, consts, x)
        at = lambda b: lax.dynamic_index_in_dim(b, j, 0, keepdims=False)  # noqa: E731
        key = None if prob.keys is None else prob.keys.key_at(kd, j)
        if plan is None:
            pullback = _step_vjp(prob, cs, [at(b) for b in buf], x, key)[1]
        else:
            pullback = _pullback_of(plan, cs, buf, ext, x, key, at)
        ct_y = [at(c) for c in ct_ys]
        g_k, g_c, g_x = pullback((s["ct"], ct_y))
        acc, it = [], iter(g_k)
        for m, a in zip([m for m, d in enumerate(kmask) if d], s["acc"], strict=True):
            g = next(it)
            # A stacked const gets its slice's cotangent added in place at the layer index.
            acc.append(a.at[x[0]].add(g) if m < S else a + g)
        s = dict(s)
        s["acc"] = acc
        s["ct"] = list(g_c)
        s["ct_xs"] = [
            lax.dynamic_update_index_in_dim(b, g, j, 0)
            for b, g in zip(s["ct_xs"], g_x, strict=True)
        ]
        s["j"] = j - 1
        return s

    state = dict(
        j=steps - 1,
        ct=list(ct_carry),
        acc=[jnp.zeros_like(c) for c in take(consts, kmask)],
        ct_xs=[jnp.zeros_like(a) for a in take(xs, xmask)],
    )
    out = _vma.while_loop(lambda s: s["j"] >= 0, body, state)
    return out["acc"], out["ct"], out["ct_xs"]


# ----------------------------------------------------------------------------- batching plumbing


def _expand(leaves):
    return [jnp.expand_dims(x, 0) for x in leaves]


def _squeeze(leaves):
    return [x[0] for x in leaves]


def _batch(leaves, batched, B):
    return [
        x if b else jnp.broadcast_to(x, (B,) + jnp.shape(x))
        for x, b in zip(leaves, batched, strict=True)
    ]


def _axes(batched):
    """vmap axes (0 or None) for a pytree of batched flags."""
    return jax.tree_util.tree_map(lambda b: 0 if b else None, batched)


def _flat_batched(tree_batched) -> list[bool]:
    return [bool(b) for b in jax.tree_util.tree_leaves(tree_batched)]


def _steps_batched(prob: Problem, n_batched: bool) -> bool:
    """Whether samples of a vmapped loop can stop at different steps."""
    return bool(n_batched) or prob.cond is not None


def _make_fwd(prob: Problem, store: bool, plan: ResidualPlan | None = None, seen=None):
    """The forward loop as a custom_vmap function of unbatched arguments.

    Returns ``(carry, ys, steps, stats)`` (+ residuals ``(buf, stride, ext)`` with ``store``;
    ``ext``, the stored-residual buffers of ``plan``, is filled by an unbatched call only: a
    batched call records ``seen["batched"] = True``, and the backward pass then recomputes)."""

    def no_ext():
        return [] if plan is None else [_vma.zeros((prob.max_steps,), a) for a in plan.stored]

    @custom_vmap
    def fwd(consts, cconsts, init, xs, n, kd):
        if not prob.thinning:
            carry, ys, steps, res, stats = forward_single(
                prob, plan, consts, cconsts, init, xs, n, kd, store=store
            )
            return (carry, ys, steps, stats) + ((res,) if store else ())
        c_axes, cc_axes = [None] * len(consts), [None] * len(cconsts)
        carry, ys, steps, res, stats = forward_batched(
            prob,
            consts,
            c_axes,
            cconsts,
            cc_axes,
            _expand(init),
            _expand(xs),
            n[None],
            None if kd is None else kd[None],
            store=store,
        )
        out = (_squeeze(carry), _squeeze(ys), steps[0], stats)
        if store:
            out = out + ((_squeeze(res[0]), res[1][0], no_ext()),)
        return out

    @fwd.def_vmap
    def fwd_rule(axis_size, in_batched, consts, cconsts, init, xs, n, kd):
        if seen is not None:
            seen["batched"] = True
        cb, ccb, ib, xb, nb, kb = in_batched
        B = axis_size
        init = _batch(init, ib, B)
        xs = _batch(xs, xb, B)
        per_sample = _steps_batched(prob, nb)
        n = _batch([n], [nb], B)[0]
        if kd is not None:
            kd = _batch([kd], [kb], B)[0]

        def run(consts, cconsts, init, xs, n, kd):
            B = n.shape[0]
            args = (prob, consts, _axes(cb), cconsts, _axes(ccb), init, xs, n, kd)
            if prob.schedule and per_sample and B > 1:
                from . import _schedule

                cands = _schedule.slot_candidates(B)
                if prob.cond is not None and prob.sched_slots is None:
                    # Stopping steps are unknown before the loop runs: a fixed share of the
                    # batch.
                    cands = (cands[min(2, len(cands) - 1)],)
                return _schedule.run_with_slots(
                    _schedule.forward_scheduled,
                    n,
                    prob.sched_slots,
                    cands,
                    *args,
                    store=store,
                    by_length=prob.cond is None,
                )
            return forward_batched(*args, store=store)

        # Under plain jit with the batch sharded over Explicit mesh axes: one loop per device.
        in_b = (cb, ccb, [True] * len(init), [True] * len(xs), True, kd is not None)
        carry, ys, steps, res, stats = _vma.per_device(
            run, (consts, cconsts, init, xs, n, kd), in_b, (n, init, xs), (merge_stats,)
        )
        # A shared depth stays unbatched, so the backward pass runs unscheduled (no waste).
        steps = steps if per_sample else steps[0]
        outs = (carry, ys, steps, stats)
        batched = ([True] * len(carry), [True] * len(ys), per_sample, False)
        if store:
            # Batched, the backward pass recomputes from the carries; ``ext`` stays unused.
            ext = no_ext()
            outs = outs + ((res[0], res[1], ext),)
            batched = batched + (([True] * len(res[0]), True, [False] * len(ext)),)
        return outs, batched

    return fwd


def _make_bwd(prob: Problem, plan: ResidualPlan | None = None, seen=None):
    def unbatched(consts, xs, kd, res, steps, ct_carry, ct_ys):
        if not prob.thinning:
            # The stored residuals are filled only when the forward pass ran unbatched; under an
            # enclosing vmap of the whole vjp (vmap(jacrev), vmap(vmap(grad))) it ran batched,
            # while this backward pass may see only its cotangents batched: recompute then.
            use = plan if not (seen or {}).get("batched") else None
            return backward_single(prob, use, consts, xs, kd, res, steps, ct_carry, ct_ys)
        c_axes = [None] * len(consts)
        buf, stride, _ = res
        acc, ct, ct_xs = backward_batched(
            prob,
            consts,
            c_axes,
            _expand(xs),
            None if kd is None else kd[None],
            (_expand(buf), stride[None]),
            steps[None],
            _expand(ct_carry),
            _expand(ct_ys),
        )
        return acc, _squeeze(ct), _squeeze(ct_xs)

    bwd = custom_vmap(unbatched)

    @bwd.def_vmap
    def bwd_rule(axis_size, in_batched, consts, xs, kd, res, steps, ct_carry, ct_ys):
        cb, xb, kb, rb, sb, ctb, ctyb = in_batched
        if not prob.thinning and not any(rb[0]):
            # The forward pass ran unbatched and only the cotangents are batched, as in
            # jacrev: one unbatched backward sweep per cotangent.
            args = (consts, xs, kd, res, steps, ct_carry, ct_ys)
            out = jax.vmap(unbatched, in_axes=tuple(_axes(b) for b in in_batched))(*args)
            return out, jax.tree_util.tree_map(lambda _: True, out)
        B = axis_size
        xs = _batch(xs, xb, B)
        if kd is not None:
            kd = _batch([kd], [kb], B)[0]
        buf, stride, _ = res
        buf = _batch(buf, rb[0], B)
        stride = _batch([stride], [rb[1]], B)[0]
        steps = _batch([steps], [sb], B)[0]
        ct_carry = _batch(ct_carry, ctb, B)
        ct_ys = _batch(ct_ys, ctyb, B)
        c_axes = _axes(cb)

        def run(consts, xs, kd, buf, stride, steps, ct_carry, ct_ys):
            B = steps.shape[0]
            args = (prob, consts, c_axes, xs, kd, (buf, stride), steps, ct_carry, ct_ys)
            # Under vmap every sample's cotangent of a shared const is its own (vmap of grad
            # and jacrev need them apart; under grad of vmap JAX sums them afterwards).
            if prob.schedule and sb and B > 1 and not prob.thinning:
                from . import _schedule

                return _schedule.run_with_slots(
                    _schedule.backward_scheduled,
                    steps,
                    prob.sched_slots,
                    _schedule.slot_candidates(B),
                    *args,
                    per_row=True,
                )
            return backward_batched(*args, per_row=True)

        # Under plain jit with the batch sharded over Explicit mesh axes: one loop per device.
        args = (consts, xs, kd, buf, stride, steps, ct_carry, ct_ys)
        in_b = (cb, [True] * len(xs), kd is not None, [True] * len(buf), True, True,
                [True] * len(ct_carry), [True] * len(ct_ys))  # fmt: skip
        acc, ct, ct_xs = _vma.per_device(run, args, in_b, (steps, buf, ct_carry))
        return (acc, ct, ct_xs), ([True] * len(acc), [True] * len(ct), [True] * len(ct_xs))

    return bwd


# ----------------------------------------------------------------------------- strategies


def run_checkpointed(prob: Problem, consts, cconsts, init, xs, n, kd):
    plan = residual_plan(prob, consts, init, xs, kd)
    fwd_plain = _make_fwd(prob, store=False)
    seen = {}
    fwd_store = _make_fwd(prob, store=True, plan=plan, seen=seen)
    bwd = _make_bwd(prob, plan, seen)
    cmask, xmask, ymask = prob.carry_mask, prob.x_mask, prob.y_mask
    kmask = [is_diff(c) for c in consts]

    @jax.custom_vjp
    def loop(consts, cconsts, init, xs, n, kd):
        return fwd_plain(consts, cconsts, init, xs, n, kd)

    vmas = {}

    def loop_fwd(consts, cconsts, init, xs, n, kd):
        vmas.update(k=_vma.varying_of(consts), c=_vma.varying_of(init), x=_vma.varying_of(xs))
        carry, ys, steps, stats, res = fwd_store(consts, cconsts, init, xs, n, kd)
        return (carry, ys, steps, stats), (consts, xs, kd, res, steps)

    def loop_bwd(saved, cts):
        with _vma.mesh_context((saved, cts)):
            return _loop_bwd(saved, cts)

    def _loop_bwd(saved, cts):
        consts, xs, kd, res, steps = saved
        ct_carry, ct_ys = cts[:2]
        ct_carry = take(_instantiate(ct_carry, prob.carry_avals), cmask)
        ct_ys = take(_instantiate(ct_ys, prob.y_avals, lead=(prob.max_steps,)), ymask)
        acc, ct_init, ct_xs = bwd(consts, xs, kd, res, steps, ct_carry, ct_ys)
        g_consts = merge(acc, [None] * (len(consts) - len(acc)), kmask)
        g_init = merge(ct_init, [None] * (len(cmask) - sum(cmask)), cmask)
        g_xs = merge(ct_xs, [None] * (len(xmask) - sum(xmask)), xmask)
        g_consts, g_init = _vma.unvary_to(g_consts, vmas["k"]), _vma.unvary_to(g_init, vmas["c"])
        g_xs = _vma.unvary_to(g_xs, vmas["x"])
        return g_consts, [None] * len(cconsts), g_init, g_xs, None, None

    loop.defvjp(loop_fwd, loop_bwd)
    return loop(consts, cconsts, init, xs, n, kd)


def run_batch(prob: Problem, consts, init, n, kd):
    """An explicitly batched loop (``repeat_batched``): one custom_vjp over the whole batch.

    The batch is the function's own, so the gradient of a parameter shared by the batch is the
    sum over its samples, accumulated inside the backward loop: no per-sample copy of any
    parameter or of its gradient. Under an enclosing ``vmap`` JAX batches this function like any
    other (per-sample semantics stay right)."""
    from . import _schedule

    B = n.shape[0]
    c_axes = [None] * len(consts)
    cmask = prob.carry_mask
    kmask = [is_diff(c) for c in consts]

    def fwd_impl(consts, init, n, kd, store):
        def run(consts, init, n, kd):
            args = (prob, consts, c_axes, [], [], init, [], n, kd)
            if n.shape[0] > 1:
                return _schedule.run_with_slots(
                    _schedule.forward_scheduled,
                    n,
                    prob.sched_slots,
                    _schedule.slot_candidates(n.shape[0]),
                    *args,
                    store=store,
                    by_length=True,
                )
            return forward_batched(*args, store=store)

        # Under plain jit with the batch sharded over Explicit mesh axes: one loop per device.
        in_b = ([False] * len(consts), [True] * len(init), True, True)
        return _vma.per_device(run, (consts, init, n, kd), in_b, (n, init), (merge_stats,))

    @jax.custom_vjp
    def loop(consts, init, n, kd):
        carry, ys, steps, _, stats = fwd_impl(consts, init, n, kd, False)
        return carry, ys, steps, stats

    vmas = {}

    def loop_fwd(consts, init, n, kd):
        vmas.update(k=_vma.varying_of(consts), c=_vma.varying_of(init))
        carry, ys, steps, res, stats = fwd_impl(consts, init, n, kd, True)
        return (carry, ys, steps, stats), (consts, kd, res, steps)

    def loop_bwd(saved, cts):
        with _vma.mesh_context((saved, cts)):
            return _loop_bwd(saved, cts)

    def _loop_bwd(saved, cts):
        consts, kd, res, steps = saved
        ct_carry = take(_instantiate(cts[0], prob.carry_avals, lead=(B,)), cmask)

        def run(consts, kd, buf, stride, steps, ct_carry):
            args = (prob, consts, c_axes, [], kd, (buf, stride), steps, ct_carry, [])
            if steps.shape[0] > 1 and not prob.thinning:
                acc, ct, _ = _schedule.run_with_slots(
                    _schedule.backward_scheduled,
                    steps,
                    prob.sched_slots,
                    _schedule.slot_candidates(steps.shape[0]),
                    *args,
                )
            else:
                acc, ct, _ = backward_batched(*args)
            return ct, acc

        # One loop per device under a batch sharded over Explicit mesh axes; the shared
        # parameters' gradients are summed over the devices afterwards.
        args = (consts, kd, res[0], res[1], steps, ct_carry)
        in_b = ([False] * len(consts), True, [True] * len(res[0]), True, True,
                [True] * len(ct_carry))  # fmt: skip
        ct, acc = _vma.per_device(
            run, args, in_b, (steps, res[0], ct_carry), (lambda acc: [a.sum(0) for a in acc],)
        )
        g_consts = merge(acc, [None] * (len(consts) - len(acc)), kmask)
        g_init = merge(ct, [None] * (len(cmask) - sum(cmask)), cmask)
        return _vma.unvary_to(g_consts, vmas["k"]), _vma.unvary_to(g_init, vmas["c"]), None, None

    loop.defvjp(loop_fwd, loop_bwd)
    return loop(consts, list(init), n, kd)


def _instantiate(cts, avals, lead=()):
    return [
        _vma.zeros(lead, a) if (c is None or _is_float0(c)) else c
        for c, a in zip(cts, avals, strict=True)
    ]


def _is_float0(x):
    return getattr(x, "dtype", None) == jax.dtypes.float0


def run_while(prob: Problem, consts, cconsts, init, xs, n, kd):
    """``lax.while_loop`` semantics with forward-mode AD; reverse mode raises a clear error."""

    def plain(consts, init, xs, cconsts, n, kd):
        carry, ys, steps, _, stats = forward_batched(
            prob,
            consts,
            [None] * len(consts),
            cconsts,
            [None] * len(cconsts),
            _expand(init),
            _expand(xs),
            n[None],
            None if kd is None else kd[None],
            store=False,
        )
        return _squeeze(carry), _squeeze(ys), steps[0], stats

    @jax.custom_jvp
    def loop(consts, init, xs, cconsts, n, kd):
        return plain(consts, init, xs, cconsts, n, kd)

    @loop.defjvp
    def loop_jvp(primals, tangents):
        consts, init, xs, cconsts, n, kd = primals
        t_consts, t_init, t_xs = tangents[:3]
        kmask = [is_diff(c) for c in consts]
        cmask, xmask, ymask = prob.carry_mask, prob.x_mask, prob.y_mask
        nk, nc, nx = len(consts), len(init), len(xs)

        def step2(consts2, carry2, x2, key):
            base, tk = consts2[:nk], consts2[nk:]
            c, tc = carry2[:nc], carry2[nc:]
            x, tx = x2[:nx], x2[nx:]

            def f(kd_, cd, xd):
                k_all = merge(kd_, take(base, kmask, False), kmask)
                return prob.step(
                    k_all,
                    merge(cd, take(c, cmask, False), cmask),
                    merge(xd, take(x, xmask, False), xmask),
                    key,
                )

            (c_new, y), (tc_new, ty) = jax.jvp(
                f, (take(base, kmask), take(c, cmask), take(x, xmask)), (tk, tc, tx)
            )
            return list(c_new) + take(list(tc_new), cmask), list(y) + take(list(ty), ymask)

        def tangent_avals(avals, mask):
            return tuple(a for a, m in zip(avals, mask, strict=True) if m)

        prob2 = dataclasses.replace(
            prob,
            step=step2,
            cond=None if prob.cond is None else (lambda cc, c2: prob.cond(cc, c2[:nc])),
            carry_avals=prob.carry_avals + tangent_avals(prob.carry_avals, cmask),
            x_avals=prob.x_avals + tangent_avals(prob.x_avals, xmask),
            y_avals=prob.y_avals + tangent_avals(prob.y_avals, ymask),
        )
        consts2 = list(consts) + take(_instantiate(t_consts, consts), kmask)
        init2 = list(init) + take(_instantiate(t_init, init), cmask)
        xs2 = list(xs) + take(_instantiate(t_xs, xs), xmask)
        carry2, ys2, steps, _, stats = forward_batched(
            prob2,
            consts2,
            [None] * len(consts2),
            cconsts,
            [None] * len(cconsts),
            _expand(init2),
            _expand(xs2),
            n[None],
            None if kd is None else kd[None],
            store=False,
        )
        carry2, ys2 = _squeeze(carry2), _squeeze(ys2)
        carry, tcarry = carry2[:nc], _reverse_guard(carry2[nc:])
        ys, tys = ys2[: len(prob.y_avals)], _reverse_guard(ys2[len(prob.y_avals) :])
        t_out_carry = merge(tcarry, [_float0_like(c) for c in take(carry, cmask, False)], cmask)
        t_out_ys = merge(tys, [_float0_like(y) for y in take(ys, ymask, False)], ymask)
        steps = steps[0]
        return (carry, ys, steps, stats), (
            t_out_carry,
            t_out_ys,
            _float0_like(steps),
            _float0_like(stats),
        )

    return loop(consts, init, xs, cconsts, n, kd)


def _float0_like(x):
    return np.zeros(jnp.shape(x), dtype=jax.dtypes.float0)


_REVERSE_MSG = (
    'strategy="while" supports forward-mode differentiation (jvp, jacfwd) only; reverse mode '
    '(grad, vjp, jacrev) needs strategy="checkpointed" (or "auto", which picks it), whose '
    "forward and backward cost both follow the steps actually taken."
)


def _raise_reverse(_, ct):
    raise TypeError(_REVERSE_MSG)


def _reverse_guard(tangents: Leaves) -> Leaves:
    """Identity on tangents whose transpose raises a clear error.

    ``linear_call`` gives the custom transpose but has no batching rule: under ``vmap`` binding it
    raises NotImplementedError at trace time. There the guard goes through a ``custom_vmap``
    whose rule sees the unbatched values and applies the guard to them (recursively, for nested
    vmaps), so the error survives ``grad(vmap(...))`` and ``jacfwd`` still works.
    """
    if not tangents:
        return tangents
    try:
        return list(linear_call(lambda _, t: t, _raise_reverse, (), list(tangents)))
    except NotImplementedError:
        return list(_batched_guard(list(tangents)))


@custom_vmap
def _batched_guard(tangents):
    return _reverse_guard(tangents)


@_batched_guard.def_vmap
def _batched_guard_rule(axis_size, in_batched, tangents):
    return _reverse_guard(tangents), in_batched[0]


def run_masked(prob: Problem, consts, cconsts, init, xs, n, kd):
    """The seed's method: ``lax.scan`` over all ``max_steps`` with ``lax.cond``."""
    T = prob.max_steps
    zeros_y = [_vma.zeros((), a) for a in prob.y_avals]

    def body(state, i):
        carry, alive, steps = state
        live = alive & (i < n)
        if prob.cond is not None:
            live = live & prob.cond(cconsts, carry)
        x = [lax.dynamic_index_in_dim(a, i, 0, keepdims=False) for a in xs]
        key = None if prob.keys is None else prob.keys.key_at(kd, i)

        def run(carry):
            c, y = prob.step(consts, carry, x, key)
            return list(c), list(y)

        if _vma.manual_axes():
            # Inside shard_map, vmap's rewrite of a cond into a select trips over the varying
            # types of the branches; run the step and select, which is what vmap does anyway.
            new_c, new_y = run(carry)
            carry = [jnp.where(live, a, b) for a, b in zip(new_c, carry, strict=True)]
            y = [jnp.where(live, a, b) for a, b in zip(new_y, zeros_y, strict=True)]
        else:
            carry, y = _vma.cond(live, run, lambda c: (list(c), zeros_y), carry)
        return (carry, live, steps + live.astype(jnp.int32)), y

    init_state = (list(init), jnp.array(True), jnp.zeros((), jnp.int32))
    (carry, _, steps), ys = _vma.scan(body, init_state, jnp.arange(T, dtype=jnp.int32))
    return carry, list(ys), steps, stats_of(jnp.asarray(T, jnp.int32), 1)


STRATEGY_FNS = {
    "masked": run_masked,
    "while": run_while,
    "checkpointed": run_checkpointed,
    "auto": run_checkpointed,
}
