"""The unbatched loop: one sample, no row axis, forward and backward sweeps.

The forward pass stores, with ``store``, the carry before every step and, with a residual plan
(:mod:`dyndepth._residuals`), each step's other residuals: the backward pass then applies each
step's pullback without running the step again. Without a plan it recomputes each step from
its stored carry. With checkpoint thinning the loop runs as a lockstep batch of one
(:mod:`dyndepth._kernels`).
"""

from __future__ import annotations

import jax.numpy as jnp

from . import _batched, _kernels, _sharding, _vma
from ._derivative import Perturbed
from ._leaves import at_index, expand, put_index, squeeze, take
from ._operands import LoopOperands
from ._residuals import ResidualPlan, pullback_of, step_vjp, stored_leaves
from ._step import Loop, step_consts
from ._store import ROW_AXIS


def forward(loop: Loop, consts, cconsts, init, xs, n, kd, *, store: bool,
            pert: Perturbed | None = None, plan: ResidualPlan | None = None):  # fmt: skip
    """Returns ``(carry, ys, steps, res, stats)``, ``res = (buf, stride, in_order, ext)`` with
    ``store``: ``buf[j]`` the carry before step ``j * stride`` (``in_order`` 0: never in
    schedule order) and ``ext`` the stored residuals of ``plan`` (for the perturbed leaves
    ``pert``), else None."""
    if loop.thinning:
        one = LoopOperands(list(consts), list(cconsts), expand(init), list(xs), n[None],
                           None if kd is None else kd[None])  # fmt: skip
        axes = LoopOperands([None] * len(consts), [None] * len(cconsts), [0] * len(init),
                            [None] * len(xs), 0, 0)  # fmt: skip
        out = _kernels.forward_outputs(*_kernels.lockstep(loop, one, axes, store=store))
        carry, ys, steps, res, (iters, _) = out
        if not store:
            return squeeze(carry), squeeze(ys), steps[0], res, _batched.stats_of(iters, 1)
        back = _batched.backward_iterations(loop, steps, res[1])
        stats = _batched.stats_of(iters, 1, (back, back), loop.slots_stored)
        res = (squeeze(res[0], ROW_AXIS), res[1][0], res[2][0], _no_ext(loop, plan))
        return squeeze(carry), squeeze(ys), steps[0], res, stats
    T = loop.max_steps

    def active(i, carry):
        act = i < n
        if loop.cond_jaxpr is not None:
            act = act & loop.cond(cconsts, carry)
        return act

    i0 = jnp.zeros((), jnp.int32)
    state = dict(i=i0, act=active(i0, init), carry=list(init),
                 ys=[_sharding.zeros((T,), a) for a in loop.y_avals])  # fmt: skip
    if store:
        state["buf"] = [_sharding.blank((T,), a) for a in loop.carry_avals]
        state["ext"] = _no_ext(loop, plan)

    def body(s):
        i, carry = s["i"], s["carry"]
        x = at_index(xs, i)
        key = loop.key_at(kd, i)
        s = dict(s)
        if plan is None:
            new_c, y = loop.step(consts, carry, x, key)
        else:
            cs = step_consts(loop.stacked, consts, x)
            (new_c, y), pullback = step_vjp(loop, pert, cs, carry, x, key)
            s["ext"] = put_index(s["ext"], i, stored_leaves(plan, pullback))
        if store:
            s["buf"] = put_index(s["buf"], i, carry)
        s["ys"] = put_index(s["ys"], i, y)
        s["carry"] = list(new_c)
        s["i"] = i + 1
        s["act"] = active(s["i"], s["carry"])
        return s

    out = _vma.while_loop(lambda s: s["act"], body, state)
    res = (
        (out["buf"], jnp.ones((), jnp.int32), jnp.zeros((), jnp.int32), out["ext"])
        if store
        else None
    )
    back = (out["i"], out["i"]) if store else (0, 0)
    stats = _batched.stats_of(out["i"], 1, back, T if store else 0)
    return out["carry"], out["ys"], out["i"], res, stats


def _no_ext(loop: Loop, plan: ResidualPlan | None):
    return [] if plan is None else [_sharding.blank((loop.max_steps,), a) for a in plan.stored]


def backward(loop: Loop, pert: Perturbed, plan: ResidualPlan | None, consts, xs, kd, res, steps,
             ct_carry, ct_ys):  # fmt: skip
    """The reverse sweep of :func:`forward`: each step's pullback, rebuilt from its stored and
    referenced residuals (with a ``plan``) or from the step's vjp at the stored carry. Returns
    the cotangents ``(consts, init, xs)`` of the perturbed leaves."""
    buf, stride, ext = res
    if loop.thinning:
        ct = _batched.backward(
            loop, pert, consts, [None] * len(consts), expand(xs),
            None if kd is None else kd[None], (expand(buf, ROW_AXIS), stride[None]), steps[None],
            expand(ct_carry), expand(ct_ys),
        )  # fmt: skip
        return ct["acc"], squeeze(ct["cur"]), squeeze(ct["ct_xs"])
    S = loop.stacked
    k_idx = [m for m, p in enumerate(pert.consts) if p]

    def body(s):
        j = s["j"]
        x = at_index(xs, j)
        cs = step_consts(S, consts, x)
        key = loop.key_at(kd, j)
        carry = at_index(buf, j)
        if plan is None:
            pullback = step_vjp(loop, pert, cs, carry, x, key)[1]
        else:
            pullback = pullback_of(plan, cs, carry, at_index(ext, j), x, key)
        # Inside shard_map the step's outputs vary like the loop state (the stored carry); a
        # cotangent replicated over those axes (jacrev's basis, shared by the samples) is
        # cast to vary like them, as the pullback requires.
        axes = _state_vma(carry)
        g_k, g_c, g_x = pullback((_vma.vary(s["ct"], axes), _vma.vary(at_index(ct_ys, j), axes)))
        # A stacked const gets its slice's cotangent added in place at the layer index.
        acc = [a.at[x[0]].add(g) if m < S else a + g
               for m, a, g in zip(k_idx, s["acc"], g_k, strict=True)]  # fmt: skip
        return dict(j=j - 1, ct=list(g_c), acc=acc, ct_xs=put_index(s["ct_xs"], j, g_x))

    state = dict(
        j=steps - 1,
        ct=list(ct_carry),
        acc=[jnp.zeros_like(c) for c in take(consts, pert.consts)],
        ct_xs=[jnp.zeros_like(a) for a in take(xs, pert.xs)],
    )
    out = _vma.while_loop(lambda s: s["j"] >= 0, body, state)
    return out["acc"], out["ct"], out["ct_xs"]


def _state_vma(carry) -> tuple[str, ...]:
    """The manual axes some leaf of the carry varies over (none outside ``shard_map``)."""
    return tuple(sorted(frozenset().union(*_vma.varying_of(list(carry)))))
