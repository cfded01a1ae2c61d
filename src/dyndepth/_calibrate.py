"""Measuring a backend's :class:`dyndepth.IterationCost` instead of taking the built-in one.

The scheduler's time model (:mod:`dyndepth._cost`) says that an iteration of a scheduled loop
over ``S`` slots costs ``fixed + S x row`` seconds. Here the scheduled loop itself is timed, as
training runs it (``value_and_grad``: a forward and a backward iteration per step):
``repeat_batched`` on a batch whose samples all take the same number of steps, at a few fixed
slot counts, so that each run's iterations are known (``B x depth / S``). The time of one
iteration is the difference between runs of two depths over the difference of their
iterations (what a call costs apart from its loops cancels), and it is a line in ``S``. Two
steps are timed: one of a few elementwise operations, whose line gives the fixed cost
(intercept) and a row's least cost (slope), and one matrix product of a known number of
operations, whose slope gives the backend's rate and whose intercept, beyond the elementwise
step's, the rate at which an iteration reads the step's weights.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks
from ._cost import IterationCost, jaxpr_flops
from ._leaves import nbytes
from ._loop import repeat_batched


def slot_counts(batch: int) -> tuple[int, ...]:
    """The slot counts timed: wrap-around schedules of ``batch / S`` times the depth in
    iterations, all of the same work. The small counts pin the line's intercept (an iteration's
    fixed cost, a few microseconds on a CPU), the large ones its slope."""
    return (1, 4, batch // 16, batch // 4, batch // 2)


# The step whose rows cost the backend's floor: a handful of elementwise operations on a row
# this wide.
FLOOR_WIDTH = 8


def measure_iteration_cost(
    *, batch: int = 512, width: int = 256, depth: int = 8, repeats: int = 5
) -> IterationCost:
    """Measure what a scheduled loop iteration costs on the default backend, as an
    :class:`IterationCost` to pass to :func:`dyndepth.set_iteration_cost`.

    What it computes, as plain Python (``t(f, d, S)``: the best of ``repeats`` wall times of
    ``value_and_grad`` of ``sum(repeat_batched(f, x, [d] * batch, slots=S) ** 2)``, compiled
    first; ``it(d, S) = batch * d / S`` its loop iterations)::

        def measure_iteration_cost(batch, width, depth, repeats):
            slots = [1, 4, batch // 16, batch // 4, batch // 2]
            add = lambda x: x * 0.5 + 0.25                   # rows of 8 floats
            mat = lambda x: x + jnp.tanh(x @ W)              # rows of `width` floats
            def per_iteration(f, S):
                return (t(f, 2 * depth, S) - t(f, depth, S)) / (it(2 * depth, S) - it(depth, S))
            fixed, floor_slope = fit_line(slots, [per_iteration(add, S) for S in slots])
            fixed_mat, slope = fit_line(slots, [per_iteration(mat, S) for S in slots])
            half = [batch // 2, batch]                 # lockstep (no moves), 8x the depth
            row = fit_line(half, [per_iteration(mat[:rows], rows) for rows in half])[1]
            moved = slope - row
            return IterationCost(fixed_seconds=fixed, flops_per_second=flops(mat) / row,
                                 row_floor_seconds=floor_slope - moved,
                                 bytes_per_second=bytes(W) / (fixed_mat - fixed),
                                 moved_row_seconds=moved)

    ``fit_line`` is a least-squares line (intercept, slope), clamped to be non-negative (the
    slope to at least 1e-15 s); ``moved`` and the floor are clamped to at least 0, and a
    lockstep line without a measurable slope (noise) leaves the moves unmeasured (``row =
    slope``, ``moved = 0``). What a
    scheduled row costs beyond a lockstep one (``moved``: the row's data moved in and out of
    its slot) is read from the matrix product, whose lockstep runs (``S`` = the rows: one
    shared step, slices; over half the batch and all of it, ``mat[:rows]`` the step on the
    first rows) give the step's own cost per row.

    Use it once per machine, before the first call of a jitted function (a compiled one keeps
    its slot counts)::

        dyndepth.set_iteration_cost(jax.default_backend(), dyndepth.measure_iteration_cost())

    It takes about ten seconds on a CPU at the defaults (twelve small programs compiled and
    timed), and should run on a quiet machine: timing noise moves the figures from run to run
    (on a 2-core CPU, the fixed cost by about a quarter). It runs eagerly (it times compiled
    calls), not under a transformation.

    **Raises:** ``ValueError`` if ``batch < 128`` (the slot counts must differ), or
    ``width``, ``depth`` or ``repeats`` is below 1; ``TypeError`` if one is not a Python int.
    """
    batch = _checks.static_nonneg_int(batch, "batch", minimum=128)
    width = _checks.static_nonneg_int(width, "width", minimum=1)
    depth = _checks.static_nonneg_int(depth, "depth", minimum=1)
    repeats = _checks.static_nonneg_int(repeats, "repeats", minimum=1)
    slots = slot_counts(batch)
    key_w, key_x = jax.random.split(jax.random.PRNGKey(0))
    W = jax.random.normal(key_w, (width, width), jnp.float32) / np.sqrt(width)

    def floor_step(x):
        return x * 0.5 + 0.25

    def matmul_step(x):
        return x + jnp.tanh(x @ W)

    def per_iteration(step, w):
        x = jax.random.normal(key_x, (batch, w), jnp.float32)
        return [_seconds_per_iteration(step, x, depth, s, repeats) for s in slots]

    row_flops = jaxpr_flops(jax.make_jaxpr(matmul_step)(jnp.zeros((width,), jnp.float32)).jaxpr)
    floor, matmul = per_iteration(floor_step, FLOOR_WIDTH), per_iteration(matmul_step, width)
    # (lockstep over half the batch and all of it: the slope is a row's cost, whatever a
    # lockstep iteration's fixed part; LOCKSTEP_DEPTHS times the steps, so that the few
    # iterations of a lockstep run add up to a measurable time)
    x = jax.random.normal(key_x, (batch, width), jnp.float32)
    lockstep = [(rows, _seconds_per_iteration(matmul_step, x[:rows], LOCKSTEP_DEPTHS * depth,
                                              rows, repeats))
                for rows in (batch // 2, batch)]  # fmt: skip
    return cost_of_lines(slots, floor, matmul, lockstep, row_flops, nbytes([W]))


# How many times the scheduled runs' steps the lockstep runs take (see measure_iteration_cost).
LOCKSTEP_DEPTHS = 8


def cost_of_lines(slots, floor_seconds, matmul_seconds, lockstep_seconds: list[tuple],
                  row_flops: float, weight_bytes: float) -> IterationCost:  # fmt: skip
    """The :class:`IterationCost` of an iteration's measured seconds at each slot count, for
    the elementwise step (``floor_seconds``) and the matrix product of ``row_flops``
    operations per row and ``weight_bytes`` of weights (``matmul_seconds``), and of the matrix
    product's lockstep iteration over a number of rows (``lockstep_seconds``: ``(rows,
    seconds)`` pairs). What the matrix product's iteration costs beyond the elementwise one's,
    whatever its rows, is reading the weights (none: an infinite rate); what its scheduled row
    costs beyond its lockstep row, moving the row in and out of its slot."""
    fixed, floor_slope = fit_line(slots, floor_seconds)
    fixed_mm, slope = fit_line(slots, matmul_seconds)
    row = fit_line(*zip(*lockstep_seconds, strict=True))[1]
    if row <= 1e-15:  # (no measurable slope: timing noise; the moves are not measured)
        row = slope
    moved = max(slope - row, 0.0)
    extra = fixed_mm - fixed
    return IterationCost(
        fixed_seconds=fixed, flops_per_second=row_flops / row,
        row_floor_seconds=max(floor_slope - moved, 0.0),
        bytes_per_second=weight_bytes / extra if extra > 0 else math.inf,
        moved_row_seconds=moved,
    )  # fmt: skip


def fit_line(xs, ys) -> tuple[float, float]:
    """The least-squares line ``y = a + b x`` through the points: ``(a, b)``, with ``a >= 0``
    and ``b >= 1e-15`` (timing noise can tilt a line through few points below zero)."""
    b, a = np.polyfit(np.asarray(xs, np.float64), np.asarray(ys, np.float64), 1)
    return max(float(a), 0.0), max(float(b), 1e-15)


def _seconds_per_iteration(step, x, depth: int, slots: int, repeats: int) -> float:
    """Seconds of one forward and one backward iteration of the scheduled loop in ``slots``
    slots: runs of ``depth`` and ``2 x depth`` steps per sample (one compiled program), the
    difference of their best times over that of their iterations."""
    B = x.shape[0]

    @jax.jit
    def run(x, depths):
        def loss(x):
            out, stats = repeat_batched(step, x, depths, max_depth=2 * depth, slots=slots,
                                        return_stats=True)  # fmt: skip
            return jnp.sum(out**2), stats["iterations"]

        return jax.value_and_grad(loss, has_aux=True)(x)

    depths = {d: jnp.full((B,), d, jnp.int32) for d in (depth, 2 * depth)}
    best = dict.fromkeys(depths, float("inf"))
    iterations = {d: jax.block_until_ready(run(x, ds))[0][1] for d, ds in depths.items()}
    for _ in range(repeats):  # (compiled and warm)
        for d, ds in depths.items():
            start = time.perf_counter()
            jax.block_until_ready(run(x, ds))
            best[d] = min(best[d], time.perf_counter() - start)
    extra = int(iterations[2 * depth]) - int(iterations[depth])
    return max(best[2 * depth] - best[depth], 0.0) / max(extra, 1)
