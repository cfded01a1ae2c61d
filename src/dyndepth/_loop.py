"""Public loop primitives: ``repeat``, ``scan`` and ``while_loop``.

All three build one :class:`~dyndepth._engine.Problem` and hand it to the strategy's runner; they
differ only in how the user's function is wrapped into a step ``(carry, x, key) -> (carry, y)``
and in the stop rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _checks, _vma
from ._engine import STRATEGY_FNS, Problem, run_batch, step_consts
from ._keys import KeySchedule, check_key

__all__ = ["repeat", "repeat_batched", "scan", "while_loop"]

Strategy = Literal["auto", "masked", "while", "checkpointed"]


def _strong(x: Any) -> jax.Array:
    x = jnp.asarray(x)
    return lax.convert_element_type(x, x.dtype) if getattr(x, "weak_type", False) else x


def _hoist(fn: Callable, *example_args: Any):
    """Closure-convert ``fn``: every value it closes over becomes an explicit argument.

    Unlike ``jax.closure_convert`` this hoists *all* constants, tracers of an enclosing ``vmap``
    included, so the loop internals (custom_vjp / custom_vmap) never close over a tracer.

    Inside ``jax.shard_map`` the examples are traced as varying over the manual mesh axes, like
    the loop state they stand for, and the arguments are made varying before each call.
    """
    example_args = jax.tree_util.tree_map(_vma.varying_example, example_args)
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*example_args)
    jaxpr, consts = closed.jaxpr, list(closed.consts)
    out_tree = jax.tree_util.tree_structure(out_shape)

    def call(consts, *args):
        leaves = _vma.vary(jax.tree_util.tree_leaves(args))
        out = _vma.eval_jaxpr(jaxpr, consts, *leaves)
        return jax.tree_util.tree_unflatten(out_tree, out)

    return call, consts, out_shape


def _carry_step(f: Callable, with_key: bool) -> Callable:
    """``f(carry[, key]) -> carry`` as a step ``(carry, x, key) -> (carry, None)``."""
    if with_key:
        return lambda carry, x, k: (f(carry, k), None)
    return lambda carry, x, k: (f(carry), None)


def _aval(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def _build(
    *,
    step_fn: Callable,
    fname: str,
    init: Any,
    xs: Any,
    length: int,
    n: jax.Array,
    key: Any,
    cond_fn: Callable | None,
    strategy: str,
    checkpoints: int | None,
    slots: int | None = None,
    batch: bool = False,
    stacked: Any = None,
):
    """Validate, closure-convert and run. Returns ``(carry, ys, steps, stats)``.

    With ``batch``, ``init``, ``n`` and ``key`` carry a leading batch axis (``xs`` must be None)
    and the loop runs as one explicitly batched custom_vjp (see ``run_batch``).

    With ``stacked`` (a pytree of arrays with a common leading axis), ``step_fn`` takes a fourth
    argument, the slice of ``stacked`` at the step's first ``xs`` leaf (an int32 index): the
    engine does the slicing, so its stored-residual path can reference the slice instead of
    storing it (see ``Problem.stacked``)."""
    strategy = _checks.strategy_arg(strategy)
    init = jax.tree_util.tree_map(_strong, init)
    carry_leaves, carry_tree = jax.tree_util.tree_flatten(init)
    xs_leaves, xs_tree = jax.tree_util.tree_flatten(xs)
    x_example = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), xs)

    keys = None
    # A placeholder when there is no key: custom_vmap's jvp rule cannot take None arguments.
    kd = jnp.zeros((), jnp.uint32)
    key_example = None
    if key is not None:
        check_key(
            jax.ShapeDtypeStruct(key.shape[1:], key.dtype) if batch else key,
            "keys[0]" if batch else "key",
        )
        keys = KeySchedule(key)
        kd = keys.data
        # Abstract, like the other examples: a key example built from the real key data would
        # carry that data's sharding type inside ``shard_map`` (varying over the mesh) while the
        # carry example does not, and the traced step would then pin a cast between the two.
        kd_example = jax.ShapeDtypeStruct(kd.shape[1:] if batch else kd.shape, kd.dtype)
        key_example = jax.eval_shape(lambda d: keys.key_at(d, jnp.zeros((), jnp.int32)), kd_example)
    elif batch:
        kd = jnp.zeros(n.shape, jnp.uint32)

    # Under jit, arrays placed on a mesh with Explicit axes are typed with its shardings: the
    # step is then traced with those types (its own reshards included), and the loop's
    # buffers take them (see below).
    typed = not _vma.manual_axes() and _vma.mesh_typed((init, xs))

    def sample_aval(a):
        if typed:
            return _vma.typed_aval(a, drop_lead=batch)
        return jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a)) if batch else _aval(a)

    if typed:
        x_example = jax.tree_util.tree_map(lambda a: _vma.typed_aval(a, drop_lead=True), xs)
    init_example = jax.tree_util.tree_map(sample_aval, init)
    stacked_leaves, stacked_tree = jax.tree_util.tree_flatten(stacked)
    S = len(stacked_leaves)
    if S:
        p_example = jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stacked
        )
        call, consts, out_shape = _hoist(step_fn, init_example, x_example, key_example, p_example)
    else:
        call, consts, out_shape = _hoist(step_fn, init_example, x_example, key_example)
    new_carry_shape, y_shape = out_shape
    _checks.carry_matches(init_example, new_carry_shape, fname)
    y_leaves_shape, y_tree = jax.tree_util.tree_flatten(y_shape)
    dtypes = [a.dtype for a in carry_leaves]

    def inner(consts, c_leaves, x_leaves, k):
        carry = jax.tree_util.tree_unflatten(carry_tree, c_leaves)
        x = jax.tree_util.tree_unflatten(xs_tree, x_leaves)
        if S:
            p = jax.tree_util.tree_unflatten(stacked_tree, consts[:S])
            new_carry, y = call(consts[S:], carry, x, k, p)
        else:
            new_carry, y = call(consts, carry, x, k)
        new_leaves = [
            jnp.asarray(a).astype(d)
            for a, d in zip(jax.tree_util.tree_leaves(new_carry), dtypes, strict=True)
        ]
        return new_leaves, jax.tree_util.tree_leaves(y)

    def step(consts, c_leaves, x_leaves, k):
        return inner(step_consts(S, consts, x_leaves), c_leaves, x_leaves, k)

    cond = None
    cconsts: list[Any] = []
    if cond_fn is not None:
        ccall, cconsts, c_out = _hoist(cond_fn, init_example)
        c_leaves = jax.tree_util.tree_leaves(c_out)
        if len(c_leaves) != 1 or c_leaves[0].shape != () or np.dtype(c_leaves[0].dtype) != np.bool_:
            got = ", ".join(f"{a.dtype}{list(a.shape)}" for a in c_leaves) or "nothing"
            raise TypeError(
                f"`cond_fun` must return a boolean scalar, got {got}; under vmap, write it for "
                "one sample"
            )

        def cond(cc, c_leaves):
            return ccall(cc, jax.tree_util.tree_unflatten(carry_tree, c_leaves))

    prob = Problem(
        step=step,
        cond=cond,
        carry_avals=tuple(sample_aval(a) for a in carry_leaves),
        x_avals=tuple(jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in xs_leaves),
        y_avals=tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in y_leaves_shape),
        max_steps=length,
        checkpoints=checkpoints,
        keys=keys,
        schedule=strategy == "auto",
        sched_slots=slots,
        stacked=S,
        inner=inner if S else None,
    )
    consts = list(stacked_leaves) + list(consts)
    if not _vma.manual_axes() and _vma.mesh_typed((consts, cconsts, carry_leaves, xs_leaves, kd)):
        # Under jit with Explicit mesh axes the loop's buffers take the types (shardings) of
        # the values written into them: the carry's, and the step outputs' as traced here.
        carry_t = tuple(_vma.typed_aval(a, drop_lead=batch) for a in carry_leaves)
        y_t = prob.y_avals
        if not batch and prob.y_avals and length > 0:
            key0 = None if keys is None else keys.key_at(kd, jnp.zeros((), jnp.int32))
            y_t = tuple(
                jax.eval_shape(
                    lambda c, cl, xl: step(c, cl, [a[0] for a in xl], key0)[1],
                    consts,
                    list(carry_t),
                    xs_leaves,
                )
            )
        prob = dataclasses.replace(prob, carry_avals=carry_t, y_avals=y_t)
    if length == 0:
        lead = n.shape if batch else ()
        ys = [jnp.zeros(lead + (0,) + a.shape, a.dtype) for a in prob.y_avals]
        carry_out, steps = carry_leaves, jnp.zeros(lead, jnp.int32)
        stats = jnp.zeros((2,), jnp.int32)
    else:
        # Under jit, arrays placed on a mesh with Explicit axes are typed with it: the loop's
        # own buffers are then created under that mesh too (as under jax.set_mesh).
        with _vma.mesh_context((consts, cconsts, carry_leaves, xs_leaves, kd)):
            if batch:
                carry_out, ys, steps, stats = run_batch(prob, consts, carry_leaves, n, kd)
            else:
                carry_out, ys, steps, stats = STRATEGY_FNS[strategy](
                    prob, consts, cconsts, carry_leaves, xs_leaves, n, kd
                )
    return (
        jax.tree_util.tree_unflatten(carry_tree, list(carry_out)),
        jax.tree_util.tree_unflatten(y_tree, list(ys)),
        steps,
        stats,
    )


def repeat(
    f: Callable,
    init: Any,
    depth: Any,
    *,
    max_depth: int,
    key: Any = None,
    strategy: Strategy = "auto",
    checkpoints: int | None = None,
    slots: int | None = None,
    checked: bool = False,
) -> Any:
    """Apply ``f`` to ``init`` ``depth`` times, where ``depth`` may be traced or batched.

    The plain-Python meaning (``key`` given; without it, ``f`` takes the carry alone)::

        def repeat(f, init, depth, *, max_depth, key):
            carry = init
            for i in range(min(max(depth, 0), max_depth)):
                carry = f(carry, dyndepth.step_key(key, i))
            return carry

    **Arguments:**

    - ``f``: ``f(carry) -> carry``, or ``f(carry, key) -> carry`` when ``key`` is given. It must
      return a carry of the same pytree structure, shapes and dtypes as ``init``. Parameters it
      closes over receive gradients.
    - ``init``: any pytree of arrays (float, int and bool leaves; zero-size arrays allowed).
    - ``depth``: a Python int or an integer scalar array. It may be traced under ``jit`` and
      batched under ``vmap`` (one depth per sample). A concrete value outside
      ``[0, max_depth]`` raises; a traced one is clamped into that range.
    - ``max_depth``: static Python int ``>= 0``, the largest depth the loop can run; it sizes
      the buffers, it does not set the cost.
    - ``key``: optional PRNG key (``jax.random.key`` or ``jax.random.PRNGKey``). Step ``i``
      receives ``dyndepth.step_key(key, i) == jax.random.fold_in(key, i)``.
    - ``strategy``: ``"auto"`` (default), ``"masked"``, ``"while"`` or ``"checkpointed"``:

      ==============  =========================================  =================================
      strategy        transformations                            cost
      ==============  =========================================  =================================
      ``"masked"``    jit, vmap, grad, jvp, all orders           ``max_depth`` steps always
                                                                 (the seed's scan + cond); under
                                                                 vmap, shared parameters are
                                                                 broadcast to the batch
      ``"while"``     jit, vmap, jvp/jacfwd; reverse mode        ``depth`` steps
                      raises a TypeError
      ``"checkpoint   jit, vmap, grad/vjp/jacrev; forward-   forward and backward follow
      ed"``           over-reverse only under vmap (JAX's        ``depth``: ``depth`` step
                      custom_vmap jvp rule fails otherwise);     evaluations unbatched (stored
                      not jvp of the loop itself                 residuals), ``2 * depth`` under
                                                                 vmap (stored carries); see
                                                                 ``checkpoints``
      ``"auto"``      as ``"checkpointed"``                      as ``"checkpointed"``, and under
                                                                 ``vmap`` with per-sample depths
                                                                 the per-sample scheduler: work
                                                                 close to ``sum(depth)``, forward
                                                                 and backward
      ==============  =========================================  =================================

      Under ``vmap`` with per-sample depths, ``"while"`` and ``"checkpointed"`` run the batch
      until its deepest sample is done, masking finished samples (``B * max(depth)`` sample
      steps); ``"auto"`` schedules samples into slots (about ``sum(depth)``). Parameters shared
      by the batch are never broadcast, and their gradient is summed inside the backward loop.
      Under ``jit`` with the vmapped batch sharded over ``Explicit`` mesh axes, ``"auto"`` and
      ``"checkpointed"`` run one loop per device on its shard, inside a ``jax.shard_map`` they
      enter themselves (README, "Scaling out").
    - ``checkpoints``: ``None`` stores something for every step. Unbatched (outside ``vmap``
      and ``shard_map``), the step's *residuals*, the values its vjp needs, as ``lax.scan``
      stores them, except that parameters the step closes over (and, in ``dyndepth.nn``, the
      layer's slice of a stacked parameter) are referenced, not copied: the backward pass then
      evaluates no step again (``depth`` step evaluations in all). If one step's residuals
      take more than 4x the carry's bytes, and under ``vmap``, the carry is stored instead
      (``max_depth`` carries of memory) and each step is evaluated once more in the backward
      pass (``2 * depth`` in all). An int ``K >= 1`` stores at most ``K``
      checkpoints, evenly spaced over the steps actually taken (spacing doubles when the slots
      fill up), and recomputes the carries between two checkpoints during the backward pass
      into a buffer of ``S`` carries, ``S`` the smallest power of two with
      ``ceil(max_depth / S) <= K``. Memory: ``K + S`` carries; step evaluations: at most
      ``3 * depth`` (exactly ``2 * depth`` when ``depth <= K``).

    - ``slots``: under ``vmap`` with per-sample depths, ``"auto"`` runs the batch through the
      per-sample scheduler (see :func:`repeat_batched`) with this many slots. ``None`` chooses
      at run time among ``B, B/2, B/4, B/8`` the largest count that the depths keep busy
      (``<= 1.1 * sum(depth) / max(depth)``), one compiled branch each; batches of 8 or fewer
      run unscheduled. For ``while_loop``, whose stopping steps are unknown up front, ``None``
      means ``ceil(B / 4)``. Ignored by the other strategies and outside ``vmap``.

    - ``checked``: verify a traced ``depth`` at run time instead of clamping it: a value outside
      ``[0, max_depth]`` raises (under jit and vmap) with the value and, under vmap, its batch
      index. Costs one host callback per call.

    **Returns:** the carry after ``min(max(depth, 0), max_depth)`` applications of ``f``.
    ``depth == 0`` returns ``init``.

    **Raises** (at trace time): ``TypeError`` if ``f`` is not callable, if ``key`` is not a PRNG
    key, if ``depth`` is not an integer, or if ``f`` changes the carry's structure, shape or
    dtype (the message names the leaf); ``ValueError`` if ``max_depth`` is negative, a concrete
    ``depth`` is out of range, ``depth`` is not a scalar, ``checkpoints < 1`` or ``strategy`` is
    unknown. ``TypeError`` for a non-int ``max_depth``/``checkpoints``.
    """
    _checks.callable_arg(f, "f")
    max_depth = _checks.static_nonneg_int(max_depth, "max_depth")
    checkpoints = _checks.checkpoints_arg(checkpoints)
    slots = _checks.slots_arg(slots)
    n = _checks.count_arg(depth, "depth", "max_depth", max_depth, checked)
    step_fn = _carry_step(f, key is not None)

    carry, _, _, _ = _build(
        step_fn=step_fn,
        fname="f",
        init=init,
        xs=None,
        length=max_depth,
        n=n,
        key=key,
        cond_fn=None,
        strategy=strategy,
        checkpoints=checkpoints,
        slots=slots,
    )
    return carry


def scan(
    f: Callable,
    init: Any,
    xs: Any = None,
    *,
    depth: Any,
    length: int | None = None,
    key: Any = None,
    strategy: Strategy = "auto",
    checkpoints: int | None = None,
    slots: int | None = None,
    checked: bool = False,
) -> tuple[Any, Any]:
    """Like ``lax.scan``, but only the first ``depth`` of the ``length`` steps run.

    The plain-Python meaning (``key`` given; without it, ``f`` takes ``(carry, x)``)::

        def scan(f, init, xs, *, depth, length, key):
            carry, ys = init, []
            for i in range(length):
                if i < depth:
                    carry, y = f(carry, xs[i], dyndepth.step_key(key, i))
                else:
                    y = zeros_like(y)
                ys.append(y)
            return carry, stack(ys)

    **Arguments:** as :func:`repeat`, plus ``xs`` (a pytree of arrays with a common leading axis
    of size ``length``, or ``None``; ``f`` then receives ``None`` as ``x``) and ``length`` (a
    static int; required when ``xs`` is ``None``, else it must equal the leading axis of
    ``xs``). ``f(carry, x) -> (carry, y)``, or ``f(carry, x, key)`` when ``key`` is given;
    ``y`` is any pytree of arrays (or ``None``). ``depth`` is a loop count in
    ``[0, length]``, traced values clamped into it.

    **Returns:** ``(carry, ys)``: ``ys`` stacks the per-step outputs along a leading axis of size
    ``length``; rows at steps ``>= depth`` are zeros. Per-step losses (progressive loss,
    halting) are built on this.

    **Transformations, strategies, checkpoints, cost:** as :func:`repeat`. The ``ys`` buffer is
    not part of the stored carry, so checkpoint memory does not grow with ``length * y``.

    **Raises:** as :func:`repeat`; ``ValueError`` when the leading axes of ``xs`` disagree with
    each other or with ``length``, or when neither ``xs`` nor ``length`` is given.
    """
    _checks.callable_arg(f, "f")
    checkpoints = _checks.checkpoints_arg(checkpoints)
    slots = _checks.slots_arg(slots)
    xs_leaves = jax.tree_util.tree_leaves(xs)
    if length is not None:
        length = _checks.static_nonneg_int(length, "length")
    if xs_leaves:
        for path, leaf in jax.tree_util.tree_leaves_with_path(xs):
            if jnp.ndim(leaf) == 0:
                raise ValueError(
                    f"every leaf of `xs` needs a leading axis to scan over; xs"
                    f"{_checks.keystr(path)} is a scalar"
                )
        lens = {int(jnp.shape(a)[0]) for a in xs_leaves}
        if len(lens) != 1:
            raise ValueError(f"the leaves of `xs` have different leading axes: {sorted(lens)}")
        (xs_len,) = lens
        if length is not None and length != xs_len:
            raise ValueError(f"`length`={length} but the leading axis of `xs` is {xs_len}")
        length = xs_len
    elif length is None:
        raise ValueError("`scan` needs `xs` or `length` to know how many steps there can be")
    xs = jax.tree_util.tree_map(jnp.asarray, xs)
    n = _checks.count_arg(depth, "depth", "length", length, checked)
    if key is None:

        def step_fn(carry, x, k):
            return f(carry, x)
    else:

        def step_fn(carry, x, k):
            return f(carry, x, k)

    carry, ys, _, _ = _build(
        step_fn=step_fn,
        fname="f",
        init=init,
        xs=xs,
        length=length,
        n=n,
        key=key,
        cond_fn=None,
        strategy=strategy,
        checkpoints=checkpoints,
        slots=slots,
    )
    return carry, ys


def scan_stacked(
    f: Callable,
    init: Any,
    xs: Any,
    stacked: Any,
    *,
    depth: Any,
    strategy: Strategy = "auto",
    checkpoints: int | None = None,
) -> Any:
    """Internal (``dyndepth.nn``): ``scan`` whose step ``f(carry, x, p) -> carry`` also gets
    ``p``, the slice of the pytree ``stacked`` at ``x[0]``, an int32 layer index and the first
    leaf of ``xs``. Returns the final carry. The arguments are the caller's to validate."""
    length = int(jnp.shape(jax.tree_util.tree_leaves(xs)[0])[0])
    carry, _, _, _ = _build(
        step_fn=lambda carry, x, k, p: (f(carry, x, p), None),
        fname="layer_fn",
        init=init,
        xs=jax.tree_util.tree_map(jnp.asarray, xs),
        length=length,
        n=_checks.count_arg(depth, "depth", "length", length, False),
        key=None,
        cond_fn=None,
        strategy=strategy,
        checkpoints=_checks.checkpoints_arg(checkpoints),
        stacked=stacked,
    )
    return carry


def while_loop(
    cond_fun: Callable,
    body_fun: Callable,
    init: Any,
    *,
    max_steps: int,
    key: Any = None,
    strategy: Strategy = "auto",
    checkpoints: int | None = None,
    return_steps: bool = False,
    slots: int | None = None,
) -> Any:
    """A bounded while loop with a data-dependent stop, reverse-differentiable.

    The plain-Python meaning (``key`` given; without it, ``body_fun`` takes the carry alone)::

        def while_loop(cond_fun, body_fun, init, *, max_steps, key):
            carry, i = init, 0
            while i < max_steps and cond_fun(carry):
                carry = body_fun(carry, dyndepth.step_key(key, i))
                i += 1
            return (carry, i) if return_steps else carry

    **Arguments:**

    - ``cond_fun``: ``cond_fun(carry) -> bool`` scalar. It receives no gradient; what it closes
      over is treated as a constant.
    - ``body_fun``: ``body_fun(carry) -> carry`` (or ``body_fun(carry, key)``), keeping the
      carry's structure, shapes and dtypes.
    - ``init``, ``key``, ``strategy``, ``checkpoints``: as :func:`repeat`, with ``max_steps`` in
      place of ``max_depth``.
    - ``max_steps``: static Python int ``>= 0``; the loop stops there even if ``cond_fun`` still
      holds.
    - ``return_steps``: also return the number of steps taken (an int32 scalar).

    **Transformations:** as :func:`repeat` for each strategy. Under ``vmap`` with a per-sample
    predicate, every sample stops at its own step; finished samples are masked.

    **Cost:** forward and backward follow the steps actually taken (``"masked"``: always
    ``max_steps``). With ``checkpoints=K``, step evaluations in forward + backward are at most
    ``3 * steps``, and exactly ``2 * steps`` when ``steps <= K`` (or ``checkpoints=None``).

    **Raises:** as :func:`repeat`; ``TypeError`` when ``cond_fun`` is not callable or does not
    return a boolean scalar.
    """
    _checks.callable_arg(cond_fun, "cond_fun")
    _checks.callable_arg(body_fun, "body_fun")
    max_steps = _checks.static_nonneg_int(max_steps, "max_steps")
    checkpoints = _checks.checkpoints_arg(checkpoints)
    slots = _checks.slots_arg(slots)
    step_fn = _carry_step(body_fun, key is not None)

    carry, _, steps, _ = _build(
        step_fn=step_fn,
        fname="body_fun",
        init=init,
        xs=None,
        length=max_steps,
        n=jnp.asarray(max_steps, jnp.int32),
        key=key,
        cond_fn=cond_fun,
        strategy=strategy,
        checkpoints=checkpoints,
        slots=slots,
    )
    return (carry, steps) if return_steps else carry


def repeat_batched(
    f: Callable,
    inits: Any,
    depths: Any,
    *,
    max_depth: int,
    keys: Any = None,
    slots: int | None = None,
    checkpoints: int | None = None,
    return_stats: bool = False,
    checked: bool = False,
) -> Any:
    """Per-sample depths for a batch, scheduled so that the work is close to ``sum(depths)``.

    The plain-Python meaning::

        def repeat_batched(f, inits, depths, *, max_depth, keys):
            return stack([repeat(f, inits[b], depths[b], max_depth=max_depth, key=keys[b])
                          for b in range(len(depths))])

    ``f`` acts on one sample. The batch runs in ``slots`` slots (static shapes): at every loop
    iteration ``f`` is applied to all slots at once; when a sample reaches its depth, its carry is
    written out and the next pending sample is loaded into the slot. Samples start longest
    first, so the tail stays short. The backward pass is scheduled the same way: each slot runs
    one sample's reverse sweep from its depth down to 0 (with ``checkpoints=None``; with
    ``checkpoints=K`` the backward pass runs unscheduled, masked over the batch). Every sample
    gets exactly the keys it gets alone: ``step_key(keys[b], i)``.

    **Arguments:**

    - ``f``: ``f(carry) -> carry`` or ``f(carry, key) -> carry`` (with ``keys``), on one sample.
    - ``inits``: a pytree whose leaves share a leading batch axis of size ``B``.
    - ``depths``: an integer array of shape ``(B,)``; may be traced. Concrete values outside
      ``[0, max_depth]`` raise, traced ones are clamped.
    - ``max_depth``: static int ``>= 0``.
    - ``keys``: ``None`` or a batch of ``B`` keys (``jax.random.split(key, B)``).
    - ``slots``: static int ``>= 1``, or ``None`` to choose at run time among
      ``B, B/2, B/4, B/8`` the largest count the depths keep busy (see :func:`repeat`).
      Executed sample-steps are ``slots x iterations``; fewer slots waste less on skewed depth
      distributions, more slots take fewer iterations.
    - ``checkpoints``: as :func:`repeat`.
    - ``checked``: as :func:`repeat`.
    - ``return_stats``: also return a dict of int32 values: ``iterations`` (loop iterations of
      the forward pass; inside ``shard_map``, this device's; under plain ``jit`` with the
      batch sharded over ``Explicit`` mesh axes, the longest device's loop and the sum over
      the devices of the executed sample-steps),
      ``executed_sample_steps`` (``slots x iterations``),
      ``useful_sample_steps`` (``sum(depths)``), and ``per_device_executed_sample_steps`` /
      ``per_device_useful_sample_steps`` (shape ``(1,)``: this device's figures, so that a
      ``shard_map`` with ``out_specs=P(axis)`` gathers one entry per device).

    **Transformations:** jit, vmap (a batch of batches: the outer vmap masks), grad, vjp, jacrev,
    forward-over-reverse. Not jvp (use ``jax.vmap(repeat, ...)`` with ``strategy="while"``).

    **Returns:** the batch of final carries (and the stats dict with ``return_stats``).

    **Raises:** as :func:`repeat`; ``ValueError`` if ``depths`` is not of shape ``(B,)`` or the
    leading axes of ``inits``/``keys`` differ from ``B``.
    """
    _checks.callable_arg(f, "f")
    max_depth = _checks.static_nonneg_int(max_depth, "max_depth")
    slots = _checks.slots_arg(slots)
    checkpoints = _checks.checkpoints_arg(checkpoints)
    depths = _checks.batch_counts_arg(depths, "depths", "max_depth", max_depth, checked)
    B = depths.shape[0]
    _checks.leading_axis(inits, "inits", B)
    if keys is not None:
        _checks.leading_axis(keys, "keys", B)

    step_fn = _carry_step(f, keys is not None)

    def run(inits, depths, keys):
        return _build(
            step_fn=step_fn,
            fname="f",
            init=inits,
            xs=None,
            length=max_depth,
            n=depths,
            key=keys,
            cond_fn=None,
            strategy="auto",
            checkpoints=checkpoints,
            slots=slots,
            batch=True,
        )[::3]

    carry, stats = run(inits, depths, keys)
    if not return_stats:
        return carry
    stats = stats.reshape(-1, 2)
    useful = jnp.sum(depths.reshape(stats.shape[0], -1), axis=1)
    return carry, {
        "iterations": jnp.max(stats[:, 0]),
        "executed_sample_steps": jnp.sum(stats[:, 1]),
        "useful_sample_steps": jnp.sum(depths),
        "per_device_executed_sample_steps": stats[:, 1],
        "per_device_useful_sample_steps": useful,
    }
