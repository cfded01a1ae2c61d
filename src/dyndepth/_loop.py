"""Public loop primitives: ``repeat``, ``scan`` and ``while_loop``.

All of them trace the user's function into one step ``(carry, x, key) -> (carry, y)``
(:func:`dyndepth._trace.trace_loop`), validate the arguments, and bind the loop primitive
(:mod:`dyndepth._primitives`) or, for ``"masked"``, run the plain ``lax`` loop; they differ only
in how the user's function is wrapped and in the stop rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp

from . import _batched, _checks, _collectives, _masked, _per_device, _primitives, _sharding
from ._keys import KeySchedule, check_key
from ._trace import StepKind, trace_loop
from ._types import Strategy

__all__ = ["repeat", "repeat_batched", "scan", "while_loop"]


def _key_parts(key: Any, name: str) -> tuple[KeySchedule | None, Any, Any]:
    """``(schedule, key data, abstract step key)`` for a loop's key (all None without one)."""
    if key is None:
        return None, None, None
    check_key(key, name)
    keys = KeySchedule.of(key)
    data = keys.data(key)
    # Abstract, with no sharding type: under an Explicit mesh the key data is typed with its
    # sharding, which the step (run per device, inside shard_map) must not pin.
    plain = jax.ShapeDtypeStruct(data.shape, data.dtype)
    example = jax.eval_shape(lambda d: keys.key_at(d, jnp.zeros((), jnp.int32)), plain)
    return keys, data, example


def _run(kind: StepKind, fn: Callable, cond_fn: Callable | None, init: Any, xs: Any, n: Any,
         key: Any, stacked: Any = None, *, length: int, strategy: str,
         checkpoints: int | None, slots: int | tuple[int, ...] | str | None,
         stats_for: str | None = None, priority_fn: Callable | None = None):  # fmt: skip
    """Trace the step, pick the strategy's runner and run. Returns ``(carry, ys, steps,
    stats)`` as the user's pytrees, ``stats`` None for the masked loop (every sample runs every
    step: it has no work of its own to report). ``stats_for``: the argument that asked for the
    stats, if any (the masked loop then raises); ``priority_fn``:
    the continuous-batching queue's order (see :func:`while_loop`)."""
    strategy = _checks.strategy_arg(strategy)
    if checkpoints is not None and strategy not in ("auto", "checkpointed"):
        raise ValueError(
            f"`checkpoints`={checkpoints} applies to strategy 'auto' and 'checkpointed' only "
            f"(strategy={strategy!r} stores nothing per step); drop it or change the strategy"
        )
    if slots is not None and strategy != "auto":
        raise ValueError(
            f"`slots`={slots} sets the per-sample scheduler of strategy 'auto' only, got "
            f"strategy={strategy!r}; drop it or use strategy='auto'"
        )
    keys, kd, key_example = _key_parts(key, "key")
    traced = trace_loop(
        kind, fn, cond_fn, init, xs, keys, key_example, stacked,
        max_steps=length, checkpoints=checkpoints, strategy=strategy, slots=slots,
        priority_fn=priority_fn,
    )  # fmt: skip
    loop = traced.loop
    operands = (traced.consts, traced.cconsts, traced.init, traced.xs, n, kd)
    if length == 0:
        ys = [jnp.zeros((0,) + a.shape, a.dtype) for a in loop.y_avals]
        carry, steps = traced.init, jnp.zeros((), jnp.int32)
        stats = jnp.zeros((_batched.STATS_WIDTH,), jnp.int32)
    elif strategy == "masked" or _collectives.uses_vmap_axis(loop):
        if stats_for is not None:
            why = ("strategy='masked'" if strategy == "masked" else
                   "a step that uses the vmap axis (it runs the masked loop)")  # fmt: skip
            raise ValueError(
                f"`{stats_for}`=True reports the work of dyndepth's loop, but {why} runs "
                "max_steps steps for every sample: there is nothing to report; drop "
                f"`{stats_for}` or use strategy 'auto', 'checkpointed' or 'while'"
            )
        carry, ys, steps, _ = _masked.run(loop, *operands)
        stats = None
    else:
        _collectives.check_uneven_trip_counts(loop, kind.fname, n, traced.init)
        # Under jit, arrays placed on a mesh with Explicit axes are typed with it: the loop's
        # own buffers are then created under that mesh too (as under jax.set_mesh).
        with _sharding.mesh_context(operands):
            carry, ys, steps, stats = _primitives.run(loop, *operands)
    return traced.carry_out(carry), traced.ys_out(ys), steps, stats


def _work_stats(stats: jax.Array) -> dict:
    """A loop's stats vector (one row per device where the devices report apart) as the
    ``return_stats`` dict (see :func:`repeat_batched`)."""
    stats = _batched.merge_stats(stats, _per_device.Across())
    return dict(zip(_STATS_NAMES, stats, strict=True))


_STATS_NAMES = ("iterations", "executed_sample_steps", "backward_iterations",
                "backward_executed_sample_steps", "stored_carries")  # fmt: skip


def _carry_kind(with_key: bool, fname: str, key_name: str = "key") -> StepKind:
    return StepKind(with_x=False, with_key=with_key, with_stacked=False, returns_y=False,
                    fname=fname, key_name=key_name)  # fmt: skip


def _indexed(with_index: bool, kind: StepKind, xs: Any, length: int) -> tuple[StepKind, Any]:
    """``(kind, xs)`` for the loop. With ``with_index``, the step is called as ``fn(i,
    carry[, x][, key])``, its per-step input ``(i, x)`` (``i`` alone without ``xs``), ``i``
    read from ``jnp.arange(length)``: a sample reads the input of its own step (under the
    per-sample scheduler too), so ``i`` is that sample's own step number, the one its key is
    folded with. The index is an input shared by a vmapped batch, not a carry: nothing more is
    stored."""
    if not _checks.bool_arg(with_index, "with_index"):
        return kind, xs
    index = jnp.arange(length, dtype=jnp.int32)
    return dataclasses.replace(kind, with_index=True), (index, xs) if kind.with_x else index


def repeat(
    f: Callable,
    init: Any,
    depth: Any,
    *,
    max_depth: int,
    key: Any = None,
    strategy: Strategy = "auto",
    checkpoints: int | None = None,
    slots: int | Sequence[int] | Literal["work"] | None = None,
    checked: bool = False,
    with_index: bool = False,
) -> Any:
    """Apply ``f`` to ``init`` ``depth`` times, where ``depth`` may be traced or batched.

    The plain-Python meaning (``key`` given; without it, ``f`` takes the carry alone)::

        def repeat(f, init, depth, *, max_depth, key):
            carry = init
            for i in range(min(max(depth, 0), max_depth)):
                carry = f(carry, dyndepth.step_key(key, i))
            return carry

    **Arguments:**

    - ``f``: ``f(carry) -> carry``, or ``f(carry, key) -> carry`` when ``key`` is given (a
      keyword-only ``key``, ``def f(carry, *, key=None)`` as Equinox writes it, is passed as
      ``key=``). It must return a carry of the same pytree structure, shapes and dtypes as
      ``init``. Parameters it closes over receive gradients.
    - ``init``: any pytree of arrays (float, int and bool leaves; zero-size arrays allowed).
    - ``depth``: a Python int or an integer scalar array. It may be traced under ``jit`` and
      batched under ``vmap`` (one depth per sample). A concrete value outside
      ``[0, max_depth]`` raises; a traced one is clamped into that range.
    - ``max_depth``: static Python int ``>= 0``, the largest depth the loop can run. It sizes
      the buffers: with ``checkpoints=None`` the carries stored for the backward pass follow
      ``max_depth`` up to the stored-carry budget, or up to 64 per sample where recomputing is
      the cheaper (see ``checkpoints``), so that a generous value costs little there
      (``benchmarks/max_depth.py``); where every carry fits the budget, they are ``max_depth``
      per sample, filled whatever the depths.
    - ``key``: optional PRNG key (``jax.random.key`` or ``jax.random.PRNGKey``). Step ``i``
      receives ``dyndepth.step_key(key, i) == jax.random.fold_in(key, i)``.
    - ``strategy``: ``"auto"`` (default), ``"masked"``, ``"while"`` or ``"checkpointed"``:

      ==================  ==========================================  =========================
      strategy            transformations                             cost
      ==================  ==========================================  =========================
      ``"auto"``          jit, vmap, grad, vjp, jacrev, jvp, jacfwd,  forward and backward
                          hessian; every order of vmap and            follow ``depth``; under
                          differentiation, whatever stands between    ``vmap`` with per-sample
                          them (``jit``, ``vjp``, ``lax.cond``,       depths the per-sample
                          ``lax.scan``, ``jax.checkpoint``).          scheduler: work close to
                          Forward over reverse (``hessian``) and      ``sum(depth)``
                          reverse over forward follow ``depth``;
                          reverse over reverse (``grad(grad(f))``)
                          transposes the backward pass's
                          derivative as the ``"masked"`` loop's
                          (``max_depth`` steps)
      ``"checkpointed"``  as ``"auto"``                               as ``"auto"``, but under
                                                                      ``vmap`` the batch runs
                                                                      until its deepest sample
                                                                      is done (``B *
                                                                      max(depth)``)
      ``"masked"``        everything, every order (plain ``lax``)     ``max_depth`` steps
                                                                      always (the scan + cond
                                                                      baseline); under ``vmap``,
                                                                      shared parameters are
                                                                      broadcast to the batch
      ``"while"``         jit, vmap, jvp, jacfwd; reverse mode        ``depth`` steps, nothing
                          raises a TypeError                          stored
      ==================  ==========================================  =========================

      Under ``jax.grad`` of a ``jax.vmap`` of the loop, a parameter the step closes over is
      shared by the batch: it is never broadcast, and its gradient is summed inside the
      backward loop (one accumulator, as in :func:`repeat_batched`). Under ``jax.vmap`` of
      ``jax.grad``, every sample's gradient is its own, as that composition means. Only what is
      differentiated is differentiated: parameters no tangent reaches stay constants of the
      backward pass (a step may apply ops without a derivative rule to them). A step or
      predicate that uses the enclosing ``vmap``'s axis (a collective such as ``lax.pmean``,
      or ``lax.axis_index``) makes the samples step in lockstep: that loop runs as
      ``"masked"`` whatever the strategy (values and gradients of the lockstep loop, cost
      ``max_depth``). Under ``jit`` with the vmapped batch sharded over ``Explicit`` mesh
      axes, ``"auto"`` and ``"checkpointed"`` run one loop per device on its shard, inside a
      ``jax.shard_map`` they enter themselves (see the "Scaling out" guide).
    - ``checkpoints``: ``None`` stores something for every step. Unbatched (outside ``vmap``
      and ``shard_map``), the step's *residuals*, the values its vjp needs, as ``lax.scan``
      stores them, except that parameters the step closes over (and, in ``dyndepth.nn``, the
      layer's slice of a stacked parameter) are referenced, not copied: the backward pass then
      evaluates no step again (``depth`` step evaluations in all). If one step's residuals
      take more than 4x the carry's bytes, and under ``vmap``, the carry is stored instead
      (``max_depth`` carries of memory) and each step is evaluated once more in the backward
      pass (``2 * depth`` in all). An int ``K >= 1`` stores at most ``K``
      checkpoints, evenly spaced over the steps actually taken (spacing doubles when the slots
      fill up), and the backward pass recomputes each segment between two checkpoints from its
      checkpoint into a buffer of up to ``K / 2`` carries per sample (under ``vmap``,
      scheduled per sample as the steps are); where a sample is deeper than about
      ``K ** 2 / 2`` steps, segments longer than that buffer make the batch's backward pass
      recompute in two levels, in lockstep (sub-checkpoints every ``sqrt`` of a segment, one
      more forward pass). Step evaluations: at most ``3 * depth`` (``4 * depth`` in two
      levels). ``None`` stores every carry while two copies of the whole loop's
      (``max_depth`` carries for every sample of the batch, every level of ``vmap``) fit the
      stored-carry budget (unless set with :func:`set_stored_carry_budget`, a quarter of one
      device's memory where the backend reports it, a TPU's or a GPU's, else 512 MiB); above
      it, as many carries per sample as fit. Where writing a carry to fresh memory costs more
      than recomputing the step (on the CPU, a step of few operations per byte of its carry),
      at most 64 per sample whatever the budget, so that a generous ``max_depth`` costs
      neither memory nor time. ``repeat_batched``'s ``return_stats`` reports the count
      (``stored_carries``) and the backward pass's work. ``checkpoints=max_depth`` stores
      every carry whatever the size. On the wrap-around schedule (a slot count that divides
      the batch), the store of ``K`` carries per sample holds every carry of every sample,
      however deep, where the schedule's iterations fit it (about: the depths' sum within
      ``K x B``): it is written in the schedule's order.

    - ``slots``: under ``vmap`` with per-sample depths, ``"auto"`` runs the batch through the
      per-sample scheduler (see :func:`repeat_batched`). ``None`` chooses at run time, by a
      model of time, among ``B, B/2, B/4, B/8``, then down by a ratio of 4 (one compiled
      branch each; a large step compiles fewer: at most 512 of its equations over the
      counts, two counts at the least, e.g. ``B, B/4, B/16`` for 129-170 equations and ``B,
      B/4`` from 171): the count of least ``C x (fixed + S x row)``, ``C`` the wrap-around
      schedule's iterations in ``S`` slots, ``fixed`` what an iteration costs on the backend
      whatever its rows and ``row`` what the step costs on one sample (read from the step's
      operations; see :func:`set_iteration_cost`). Counts below ``fixed / 8`` rows are left
      out: where an iteration's fixed cost dwarfs the step (a GPU, a small step), a batch may
      run in lockstep, one copy of the step. ``"work"`` chooses instead among ``B, B/2,
      B/16, B/128, ..., 1`` the largest count whose schedule executes at most
      ``sum(depth) / 16`` sample-steps more than ``sum(depth)``: that bound holds for every
      distribution of depths, forward and backward. Batches of 2 or fewer run unscheduled.
      An int fixes the count (one branch); a sequence of ints is the counts the time model
      chooses among (counts of ``B`` or more run the lockstep batch). For ``while_loop``,
      whose stopping steps are unknown up front, the forward pass runs
      ``slots`` slots (the largest of a sequence; for ``None`` and ``"work"``, ``ceil(B / 4)``,
      or all ``B`` where an iteration's fixed cost outweighs ``B / 4`` rows) and its
      backward pass follows the rule above. Other strategies reject it; outside ``vmap``
      there is nothing to schedule.

    - ``checked``: verify a traced ``depth`` at run time instead of clamping it: a value outside
      ``[0, max_depth]`` raises (under jit and vmap) with the value and, under vmap, its batch
      index. Costs one host callback per call.
    - ``with_index``: call ``f(i, carry)`` (``f(i, carry, key)`` with ``key``), ``i`` the step's
      index, an int32 scalar from 0, as ``lax.fori_loop`` calls ``body_fun(i, val)``: a key
      schedule like ``fold_in(key, offset + i)`` or a per-step embedding without threading a
      counter through the carry. Under ``vmap`` it is each sample's own step number (the one
      its key is folded with), under the per-sample scheduler too. It is read from a shared
      ``jnp.arange(max_depth)``: nothing is stored per sample and the carry is unchanged.
      :func:`scan`, :func:`while_loop`, :func:`repeat_batched` and
      ``dyndepth.nn.recurrent_depth`` take it too.

    **Returns:** the carry after ``min(max(depth, 0), max_depth)`` applications of ``f``.
    ``depth == 0`` returns ``init``.

    **Raises** (at trace time): ``TypeError`` if ``f`` is not callable, if its signature does
    not take the call that ``key`` and ``with_index`` decide (the message names them and the
    call expected), if ``key`` is not a PRNG key, if ``depth`` is not an integer, if
    ``checked`` is not a bool, or if ``f`` changes the carry's structure, shape or dtype (the
    message names the leaf); ``ValueError`` if
    ``max_depth`` is negative, a concrete ``depth`` is out of range, ``depth`` is not a scalar,
    ``checkpoints < 1``, ``strategy`` is unknown, ``checkpoints`` is given to ``"masked"`` or
    ``"while"``, ``slots`` to a strategy other than ``"auto"``, or ``slots`` is an empty
    sequence or a string other than ``"work"``. ``TypeError`` for a non-int
    ``max_depth``/``checkpoints``/``slots`` (or entry of it). Reverse mode of ``"while"``
    raises a ``TypeError`` when differentiated. Under ``vmap``, a step that draws from an
    ``rbg``/``unsafe_rbg`` key runs one sample after another (JAX's vmap of those generators
    mixes the samples' draws), and with ``"masked"`` a batched such key raises a
    ``ValueError`` at trace time.
    """
    # max_depth-cost: the docstring's `max_depth` and `checkpoints` entries say what an unused
    # max_depth costs (benchmarks/max_depth.py).
    _checks.callable_arg(f, "f")
    max_depth = _checks.static_nonneg_int(max_depth, "max_depth")
    checkpoints = _checks.checkpoints_arg(checkpoints)
    slots = _checks.slots_arg(slots)
    checked = _checks.bool_arg(checked, "checked")
    n = _checks.count_arg(depth, "depth", "max_depth", max_depth, checked)
    kind, xs = _indexed(with_index, _carry_kind(key is not None, "f"), None, max_depth)
    carry, _, _, _ = _run(
        kind, f, None, init, xs, n, key,
        length=max_depth, strategy=strategy, checkpoints=checkpoints, slots=slots,
    )  # fmt: skip
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
    slots: int | Sequence[int] | Literal["work"] | None = None,
    checked: bool = False,
    with_index: bool = False,
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
    ``[0, length]``, traced values clamped into it. With ``with_index=True``,
    ``f(i, carry, x)`` (``f(i, carry, x, key)`` with ``key``), ``i`` the step's index.

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
    checked = _checks.bool_arg(checked, "checked")
    n = _checks.count_arg(depth, "depth", "length", length, checked)
    kind = StepKind(with_x=True, with_key=key is not None, with_stacked=False, returns_y=True)
    kind, xs = _indexed(with_index, kind, xs, length)
    carry, ys, _, _ = _run(
        kind, f, None, init, xs, n, key,
        length=length, strategy=strategy, checkpoints=checkpoints, slots=slots,
    )  # fmt: skip
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
    kind = StepKind(with_x=True, with_key=False, with_stacked=True, returns_y=False,
                    fname="layer_fn")  # fmt: skip
    carry, _, _, _ = _run(
        kind, f, None, init, jax.tree_util.tree_map(jnp.asarray, xs),
        _checks.count_arg(depth, "depth", "length", length, False), None, stacked,
        length=length, strategy=strategy, checkpoints=_checks.checkpoints_arg(checkpoints),
        slots=None,
    )  # fmt: skip
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
    slots: int | Sequence[int] | Literal["work"] | None = None,
    with_index: bool = False,
    priority: Callable | None = None,
    return_info: bool = False,
    return_steps: bool | None = None,
    return_stats: bool | None = None,
) -> Any:
    """A bounded while loop with a data-dependent stop, reverse-differentiable.

    The plain-Python meaning (``key`` given; without it, ``body_fun`` takes the carry alone)::

        def while_loop(cond_fun, body_fun, init, *, max_steps, key):
            carry, i = init, 0
            while i < max_steps and cond_fun(carry):
                carry = body_fun(carry, dyndepth.step_key(key, i))
                i += 1
            return (carry, {"steps": i, ...}) if return_info else carry

    **Arguments:**

    - ``cond_fun``: ``cond_fun(carry) -> bool`` scalar. It receives no gradient; what it closes
      over is treated as a constant.
    - ``body_fun``: ``body_fun(carry) -> carry`` (or ``body_fun(carry, key)``), keeping the
      carry's structure, shapes and dtypes.
    - ``init``, ``key``, ``strategy``, ``checkpoints``: as :func:`repeat`, with ``max_steps`` in
      place of ``max_depth``.
    - ``max_steps``: static Python int ``>= 0``; the loop stops there even if ``cond_fun`` still
      holds.
    - ``with_index``: ``body_fun(i, carry)`` (``body_fun(i, carry, key)`` with ``key``), ``i``
      the step's index, as for :func:`repeat`; ``cond_fun`` still takes the carry alone.
    - ``priority``: ``priority(carry) -> number`` (an int or float scalar, for one sample), or
      ``None``. A scheduling hint that never changes results: under ``vmap``, continuous
      batching starts the samples in decreasing ``priority(init)`` (ties and ``None`` in batch
      order). Give an estimate of each sample's steps (a string's length, a puzzle's blanks)
      so that long samples start early and the batch's last iterations are not spent on one
      late long sample in otherwise idle slots. Only that scheduler reads it (``"auto"``
      under ``vmap`` with fewer slots than samples); every other loop has no queue to order.
      It receives no gradient, like ``cond_fun``.
    - ``return_info``: also return a dict of int32 scalars about the loop that ran:

      - ``"steps"``: the steps taken (each sample's own under ``vmap``);
      - ``"iterations"`` and ``"executed_sample_steps"``: the forward loop's iterations and
        the rows it ran the step on, summed over its iterations. Unbatched, both are the steps
        taken. Under ``vmap`` the batch runs one loop (continuous batching) and every sample
        receives that loop's figures; ``executed_sample_steps / sum(steps)`` is then its
        overhead. Inside ``shard_map``, this device's loop; under plain ``jit`` with the batch
        sharded over ``Explicit`` mesh axes, the longest device's iterations and the sum over
        the devices. ``None`` where the masked loop ran (``strategy="masked"``, or a step that
        uses the axis of an enclosing ``vmap``): it runs ``max_steps`` steps for every sample.
      - ``"backward_iterations"``, ``"backward_executed_sample_steps"``,
        ``"stored_carries"``: as :func:`repeat_batched`'s stats (zero outside
        differentiation; ``None`` where the masked loop ran).

    - ``return_steps``, ``return_stats``: deprecated (a ``DeprecationWarning``; they will be
      removed in the next release), use ``return_info``. ``return_steps=True`` returns
      ``(carry, steps)``, ``return_stats=True`` ``(carry, stats)`` (``stats`` the dict above
      without ``"steps"``; a ``ValueError`` where the masked loop runs), both ``(carry, steps,
      stats)``.

    **Transformations:** as :func:`repeat` for each strategy. Under ``vmap`` with a per-sample
    predicate, every sample stops at its own step; finished samples are masked.

    **Cost:** forward and backward follow the steps actually taken (``"masked"``: always
    ``max_steps``). Step evaluations in forward + backward: with ``checkpoints=None``,
    ``steps`` unbatched (stored residuals; ``2 * steps`` when they exceed their budget) and
    ``2 * steps`` under ``vmap``; with ``checkpoints=K``, at most ``3 * steps``, and exactly
    ``2 * steps`` when ``steps <= K``.

    **Returns:** the final carry; ``(carry, info)`` with ``return_info``.

    **Raises:** as :func:`repeat`; ``TypeError`` when ``cond_fun`` is not callable or does not
    return a boolean scalar, or ``priority`` is neither None nor a callable returning a real
    scalar; ``ValueError`` for ``return_info`` together with a deprecated ``return_steps`` or
    ``return_stats``, and for ``return_stats`` with ``strategy="masked"`` (or a step that uses
    the axis of an enclosing ``vmap``, which runs the masked loop).
    """
    _checks.callable_arg(cond_fun, "cond_fun")
    _checks.callable_arg(body_fun, "body_fun")
    if priority is not None:
        _checks.callable_arg(priority, "priority")
    max_steps = _checks.static_nonneg_int(max_steps, "max_steps")
    checkpoints = _checks.checkpoints_arg(checkpoints)
    slots = _checks.slots_arg(slots)
    return_info = _checks.bool_arg(return_info, "return_info")
    return_steps, return_stats = _deprecated_returns(return_steps, return_stats, return_info)
    kind = _carry_kind(key is not None, "body_fun")
    kind, xs = _indexed(with_index, kind, None, max_steps)
    carry, _, steps, stats = _run(
        kind, body_fun, cond_fun, init, xs, jnp.asarray(max_steps, jnp.int32), key,
        length=max_steps, strategy=strategy, checkpoints=checkpoints, slots=slots,
        stats_for="return_stats" if return_stats else None, priority_fn=priority,
    )  # fmt: skip
    if return_info:
        work = dict.fromkeys(_STATS_NAMES) if stats is None else _work_stats(stats)
        return carry, {"steps": steps, **work}
    out = [carry] + ([steps] if return_steps else [])
    if return_stats:
        out.append(_work_stats(stats))
    return out[0] if len(out) == 1 else tuple(out)


def _deprecated_returns(return_steps: Any, return_stats: Any, return_info: bool) -> tuple:
    """``while_loop``'s deprecated ``return_steps`` and ``return_stats`` as two bools, with a
    ``DeprecationWarning`` for each one given."""
    given = {n: v for n, v in (("return_steps", return_steps), ("return_stats", return_stats))
             if v is not None}  # fmt: skip
    for name, value in given.items():
        _checks.bool_arg(value, name)
        instead = ('`info["steps"]`' if name == "return_steps" else
                   '`info["iterations"]` and `info["executed_sample_steps"]`')  # fmt: skip
        _checks.deprecated(
            f"`{name}` is deprecated and will be removed in the next release: "
            f"`carry, info = while_loop(..., return_info=True)` gives {instead}"
        )
        if return_info:
            raise ValueError(f"`return_info` replaces `{name}`: give one of them, not both")
    return bool(return_steps), bool(return_stats)


def repeat_batched(
    f: Callable,
    inits: Any,
    depths: Any,
    *,
    max_depth: int,
    keys: Any = None,
    slots: int | Sequence[int] | Literal["work"] | None = None,
    checkpoints: int | None = None,
    return_stats: bool = False,
    checked: bool = False,
    with_index: bool = False,
) -> Any:
    """Per-sample depths for a batch, scheduled so that the work is close to ``sum(depths)``.

    The plain-Python meaning::

        def repeat_batched(f, inits, depths, *, max_depth, keys):
            return stack([repeat(f, inits[b], depths[b], max_depth=max_depth, key=keys[b])
                          for b in range(len(depths))])

    ``f`` acts on one sample. The batch runs in ``slots`` slots (static shapes): at every loop
    iteration ``f`` is applied to all slots at once. The samples' steps are laid end to end
    (``W = sum(depths)`` of them) and cut into ``slots`` runs of ``C = max(max(depths),
    ceil(W / slots))`` iterations (McNaughton's wrap-around rule): a sample cut by a boundary
    runs its first steps at the start of the next slot and its last ones at the end of its own,
    its carry waiting in between. Executed sample-steps are ``slots x C``: below ``W + slots``
    when ``slots <= W / max(depths)``. The backward pass is scheduled the same way over the
    reverse sweeps (with ``checkpoints=None``; with ``checkpoints=K``, given or chosen by the
    memory budget of :func:`repeat`, it runs unscheduled, masked over the batch). Every sample
    gets exactly the keys it gets alone: ``step_key(keys[b], i)``.

    **Arguments:**

    - ``f``: ``f(carry) -> carry`` or ``f(carry, key) -> carry`` (with ``keys``), on one sample.
    - ``inits``: a pytree whose leaves share a leading batch axis of size ``B``.
    - ``depths``: an integer array of shape ``(B,)``, or one depth for the whole batch (shape
      ``()`` or a Python int: the batch runs in lockstep, unscheduled, and compiles one copy of
      ``f`` forward and backward, like ``"checkpointed"``; ``B`` is then the leading axis of
      ``inits``); may be traced. Concrete values outside ``[0, max_depth]`` raise, traced
      ones are clamped.
    - ``max_depth``: static int ``>= 0``.
    - ``keys``: ``None`` or a batch of ``B`` keys (``jax.random.split(key, B)``).
    - ``slots``: static int ``>= 1``; ``None`` to choose at run time the count of least
      modeled time (see :func:`repeat`); ``"work"`` to choose the largest count that executes
      at most ``sum(depths) / 16`` sample-steps more than ``sum(depths)``, a bound that holds
      for every distribution of depths, forward and backward; or a sequence of counts for
      the time model to choose among. More slots take fewer iterations (``C``), which is
      what a wide accelerator wants. Each candidate count is a compiled copy of ``f``,
      forward and backward: fewer counts compile faster.
    - ``checkpoints``: as :func:`repeat`.
    - ``checked``: as :func:`repeat`.
    - ``with_index``: ``f(i, carry)`` (``f(i, carry, key)`` with ``keys``), ``i`` the sample's
      own step number (see :func:`repeat`).
    - ``return_stats``: also return a dict of int32 values: ``iterations`` (loop iterations of
      the forward pass; inside ``shard_map``, this device's; under plain ``jit`` with the
      batch sharded over ``Explicit`` mesh axes, the longest device's loop and the sum over
      the devices of the executed sample-steps),
      ``executed_sample_steps`` (``slots x iterations``),
      ``useful_sample_steps`` (``sum(depths)``), the backward pass's ``backward_iterations``
      and ``backward_executed_sample_steps`` (rows it ran the step's vjp or a recompute on:
      ``sum(depths)`` plus the recompute of thinned checkpoints, about ``2 x sum(depths)``
      at most, scheduling waste aside) and ``stored_carries`` (the store's room for it, in
      carries per sample: ``max_depth``, or fewer, see ``checkpoints`` in :func:`repeat`; in
      schedule order every carry where the schedule fits it), the three zero
      outside differentiation (read them from a ``value_and_grad`` with ``has_aux``), and
      ``per_device_executed_sample_steps`` /
      ``per_device_useful_sample_steps`` (shape ``(1,)``: this device's figures, so that a
      ``shard_map`` with ``out_specs=P(axis)`` gathers one entry per device).

    **Transformations:** jit, vmap (a batch of batches: the outer vmap masks), grad, vjp, jacrev,
    jvp, jacfwd, forward over reverse (``jax.hessian``), reverse over reverse (``grad(grad(f))``,
    a ``jit`` or ``lax`` control flow between the two or not: the backward pass's derivative
    transposed as the ``"masked"`` loop's, ``max_depth`` steps, unscheduled).

    **Returns:** the batch of final carries (and the stats dict with ``return_stats``).

    **Raises:** as :func:`repeat`; ``ValueError`` if ``depths`` is not of shape ``(B,)`` or
    ``()``, or the leading axes of ``inits``/``keys`` differ from ``B``.
    """
    _checks.callable_arg(f, "f")
    max_depth = _checks.static_nonneg_int(max_depth, "max_depth")
    slots = _checks.slots_arg(slots)
    checkpoints = _checks.checkpoints_arg(checkpoints)
    checked = _checks.bool_arg(checked, "checked")
    depths = _checks.batch_counts_arg(depths, "depths", "max_depth", max_depth, checked)
    shared = depths.ndim == 0
    B = _checks.leading_axis(inits, "inits", None if shared else depths.shape[0])
    if keys is not None:
        _checks.leading_axis(keys, "keys", B, "depths" if not shared else "inits")
        check_key(jax.ShapeDtypeStruct(keys.shape[1:], keys.dtype), "keys[0]")

    kind, xs = _indexed(with_index, _carry_kind(keys is not None, "f", "keys"), None, max_depth)

    def one(init, depth, key):
        carry, _, _, stats = _run(
            kind, f, None, init, xs, depth, key,
            length=max_depth, strategy="auto", checkpoints=checkpoints, slots=slots,
        )  # fmt: skip
        return carry, stats

    # The batch is the loop's own batching level: vmap of the per-sample loop runs the
    # scheduler, forward and backward (and a shared parameter's gradient is summed inside it);
    # one depth for the batch runs it in lockstep, with nothing to schedule.
    in_axes = (0, None if shared else 0, None if keys is None else 0)
    run = jax.vmap(one, in_axes=in_axes, out_axes=(0, None))
    if B == 0:
        carry, stats = inits, jnp.zeros((_batched.STATS_WIDTH,), jnp.int32)
    else:
        carry, stats = run(inits, depths, keys)
    if not return_stats:
        return carry
    stats = stats.reshape(-1, _batched.STATS_WIDTH)
    per_sample = jnp.broadcast_to(depths, (B,))
    useful = jnp.sum(per_sample.reshape(stats.shape[0], -1), axis=1)
    return carry, {
        **_work_stats(stats),
        "useful_sample_steps": jnp.sum(per_sample),
        "per_device_executed_sample_steps": stats[:, 1],
        "per_device_useful_sample_steps": useful,
    }
