"""``strategy="masked"``: the scan + cond baseline, ``lax.scan`` over all ``max_steps`` with
``lax.cond``. Plain ``lax`` code: every transformation is JAX's own."""

from __future__ import annotations

import functools
import weakref

import jax
import jax.numpy as jnp
from jax import lax

from . import _sharding, _vma
from ._batched import stats_of
from ._keys import mixed_draws, refuse_batched
from ._step import Loop

_JITTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def run(loop: Loop, consts, cconsts, init, xs, n, kd):
    """``(carry, ys, steps, stats)``: every step evaluated, those past the end discarded.

    Through one ``jax.jit`` per loop: called again (un-jitted) with the same loop, which the
    step's conversion caches, the compiled scan is reused instead of traced and compiled anew.
    """
    jitted = _JITTED.get(loop)
    if jitted is None:
        jitted = _JITTED[loop] = jax.jit(functools.partial(_run, loop))
    carry, ys, steps, stats = jitted(list(consts), list(cconsts), list(init), list(xs), n, kd)
    return list(carry), list(ys), steps, stats


def _run(loop: Loop, consts, cconsts, init, xs, n, kd):
    # Inside shard_map, consts varying like the loop's other operands before the loop: a
    # replicated const's gradient then accumulates per device in the scan's transpose and is
    # summed over the devices once, after it, instead of by a collective at every step.
    consts, init, xs, kd = _refuse_mixed_draws(loop, consts, init, xs, kd)
    axes = _vma.state_axes_of([consts, cconsts, init, xs, n, kd])
    consts, cconsts = _vma.vary(list(consts), axes), _vma.vary(list(cconsts), axes)
    zeros_y = [_sharding.zeros((), a) for a in loop.y_avals]

    def body(state, i):
        carry, alive, steps = state
        live = alive & (i < n)
        if loop.cond_jaxpr is not None:
            live = live & loop.cond(cconsts, carry)
        x = [lax.dynamic_index_in_dim(a, i, 0, keepdims=False) for a in xs]
        key = None if loop.keys is None else loop.keys.key_at(kd, i)

        def step(carry):
            return loop.step(consts, carry, x, key)

        if _sharding.manual_axes():
            # Inside shard_map, vmap's rewrite of a cond into a select trips over the varying
            # types of the branches; run the step and select, which is what vmap does anyway.
            new_c, new_y = step(carry)
            carry = [jnp.where(live, a, b) for a, b in zip(new_c, carry, strict=True)]
            y = [jnp.where(live, a, b) for a, b in zip(new_y, zeros_y, strict=True)]
        else:
            carry, y = _vma.cond(live, step, lambda c: (list(c), zeros_y), carry)
        return (carry, live, steps + live.astype(jnp.int32)), y

    # Made from the depth, typed like it: under vmap the state turns batched, and JAX's batching
    # of a scan carry made from a constant fails on an Explicit mesh ("Resource axis ... not
    # found in mesh: ()", jax 0.10).
    init_state = (list(init), jnp.ones_like(n, bool), jnp.zeros_like(n, jnp.int32))
    T = loop.max_steps
    (carry, _, steps), ys = _vma.scan(body, init_state, jnp.arange(T, dtype=jnp.int32))
    return carry, list(ys), steps, stats_of(jnp.asarray(T, jnp.int32), 1)


def _refuse_mixed_draws(loop: Loop, consts, init, xs, kd):
    """The operands that reach a draw whose ``vmap`` would mix the samples' numbers (an
    ``rbg`` key's), behind a guard that refuses to be batched (see
    :func:`dyndepth._keys.refuse_batched`)."""
    impl, reaches = mixed_draws(loop.step_jaxpr.jaxpr)
    if loop.keys is not None and not loop.keys.batches_per_sample:
        impl = impl or loop.keys.name
        kd = refuse_batched(kd, impl, loop.strategy)
    if impl is None:
        return consts, init, xs, kd
    nk, nc = loop.n_consts, len(init)

    def guard(values, flags):
        return [refuse_batched(v, impl, loop.strategy) if f else v
                for v, f in zip(values, flags, strict=True)]  # fmt: skip

    return (guard(consts, reaches[:nk]), guard(init, reaches[nk : nk + nc]),
            guard(xs, reaches[nk + nc : nk + nc + len(xs)]), kd)  # fmt: skip
