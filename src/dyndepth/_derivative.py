"""The structure of a loop's derivative: which leaves carry tangents (:func:`perturbation`),
and the loop of ``(primal, tangent)`` pairs that forward mode runs (:func:`jvp_loop`)."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Literal

from . import _vma
from ._leaves import merge, take
from ._step import Loop, closure_convert


def perturbed_outputs(jaxpr: ClosedJaxpr, perturbed: Sequence[bool]) -> list[bool]:
    """Which outputs of ``jaxpr`` depend on its perturbed inputs (a conservative forward data
    flow: an equation's floating outputs are perturbed when any of its inputs is, except
    through ``stop_gradient``). Integer and boolean outputs are never perturbed."""
    env: dict = {}
    for v, p in zip(jaxpr.jaxpr.invars, perturbed, strict=True):
        env[v] = bool(p)

    def read(v):
        return False if isinstance(v, Literal) else env.get(v, False)

    for eqn in jaxpr.jaxpr.eqns:
        hit = eqn.primitive.name != "stop_gradient" and any(read(v) for v in eqn.invars)
        for o in eqn.outvars:
            env[o] = hit and _is_float_aval(o.aval)
    return [read(v) and _is_float_aval(v.aval) for v in jaxpr.jaxpr.outvars]


def _is_float_aval(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


@dataclasses.dataclass(frozen=True)
class Perturbed:
    """Which leaves carry tangents: consts, carry (a fixpoint over the steps), xs and ys."""

    consts: tuple[bool, ...]
    carry: tuple[bool, ...]
    xs: tuple[bool, ...]
    ys: tuple[bool, ...]

    @property
    def any(self) -> bool:
        return any(self.carry) or any(self.ys)


def perturbation(loop: Loop, consts: Sequence[bool], init: Sequence[bool],
                 xs: Sequence[bool]) -> Perturbed:  # fmt: skip
    """Propagate perturbed inputs through the steps to a fixpoint on the carry."""
    consts = tuple(bool(c) and _is_float_aval(a) for c, a in
                   zip(consts, loop.step_jaxpr.in_avals, strict=False))  # fmt: skip
    carry = tuple(bool(c) and _is_float_aval(a) for c, a in
                  zip(init, loop.carry_avals, strict=True))  # fmt: skip
    xs = tuple(bool(c) and _is_float_aval(a) for c, a in zip(xs, loop.x_avals, strict=True))
    nk = 0 if loop.keys is None else 1
    nc = len(carry)
    while True:
        out = perturbed_outputs(loop.step_jaxpr, consts + carry + xs + (False,) * nk)
        new = tuple(a or b for a, b in zip(carry, out[:nc], strict=True))
        if new == carry:
            return Perturbed(consts, carry, xs, tuple(out[nc:]))
        carry = new


_JVP_LOOPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def jvp_loop(loop: Loop, pert: Perturbed) -> Loop:
    """The loop of ``(primal, tangent)`` pairs: consts, carry, xs and ys extended with the
    tangents of their perturbed leaves; its step is the ``jax.jvp`` of the original step."""
    table = _JVP_LOOPS.setdefault(loop, {})
    if pert in table:
        return table[pert]
    S, nk = loop.stacked, loop.n_consts
    const_avals = list(loop.step_jaxpr.in_avals[:nk])
    kp = list(pert.consts)
    order = const_order(loop, pert)
    t_avals = take(const_avals, kp)
    all_avals = const_avals + t_avals
    consts2 = [all_avals[j] for j in order]
    carry2 = list(loop.carry_avals) + take(loop.carry_avals, pert.carry)
    x2 = list(loop.x_avals) + take(loop.x_avals, pert.xs)
    nc, nx = len(loop.carry_avals), len(loop.x_avals)

    def step2(*args):
        ks = args[: len(consts2)]
        flat = [None] * len(all_avals)
        for pos, j in enumerate(order):
            flat[j] = ks[pos]
        base, tk = flat[:nk], flat[nk:]
        c2 = args[len(consts2) : len(consts2) + len(carry2)]
        rest = args[len(consts2) + len(carry2) :]
        x_2, key = rest[: len(x2)], (rest[len(x2)] if loop.keys is not None else None)
        c, tc, x, tx = c2[:nc], c2[nc:], x_2[:nx], x_2[nx:]

        def f(kd_, cd, xd):
            return loop.inner(
                merge(kd_, take(base, kp, False), kp),
                merge(cd, take(c, pert.carry, False), pert.carry),
                merge(xd, take(x, pert.xs, False), pert.xs),
                key,
            )

        primals = (take(base, kp), take(c, pert.carry), take(x, pert.xs))
        (c_new, y), (tc_new, ty) = jax.jvp(f, primals, (list(tk), list(tc), list(tx)))
        return list(c_new) + take(tc_new, pert.carry), list(y) + take(ty, pert.ys)

    key_args = [] if loop.keys is None else [loop.step_jaxpr.in_avals[-1]]
    jaxpr, consts, _ = closure_convert(step2, *consts2, *carry2, *x2, *key_args)
    assert not consts
    derived = dataclasses.replace(
        loop,
        step_jaxpr=jaxpr,
        cond_jaxpr=_jvp_cond(loop, pert),
        n_consts=len(consts2),
        carry_avals=tuple(carry2),
        x_avals=tuple(x2),
        y_avals=tuple(loop.y_avals) + tuple(take(loop.y_avals, pert.ys)),
        stacked=S + sum(kp[:S]),
    )
    table[pert] = derived
    return derived


def _jvp_cond(loop: Loop, pert: Perturbed) -> ClosedJaxpr | None:
    """The stop predicate of :func:`jvp_loop`'s loop: the loop's, reading the primal carry
    (the tangents appended to the carry are ignored)."""
    if loop.cond_jaxpr is None:
        return None
    cj, nc = loop.cond_jaxpr, len(loop.carry_avals)
    cond, cc, _ = closure_convert(
        lambda *a: _vma.eval_jaxpr(cj.jaxpr, list(cj.consts), *a[: loop.n_cconsts + nc]),
        *cj.in_avals, *take(loop.carry_avals, pert.carry),
    )  # fmt: skip
    assert not cc
    return cond


def const_order(loop: Loop, pert: Perturbed) -> list[int]:
    """The derived loop's consts as positions in ``consts + perturbed tangents``: stacked
    operands and their tangents first, so that the derived step slices both (see
    :func:`jvp_loop`)."""
    S, nk = loop.stacked, loop.n_consts
    tangent = {j: nk + r for r, j in enumerate(j for j in range(nk) if pert.consts[j])}
    order = list(range(S)) + [tangent[j] for j in range(S) if j in tangent]
    return order + list(range(S, nk)) + [tangent[j] for j in range(S, nk) if j in tangent]
