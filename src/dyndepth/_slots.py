"""How many slots a scheduled batch runs in: the slot-count policy, apart from the kernels.

A batch of ``B`` samples with per-sample step counts runs in ``S <= B`` slots (static shapes, one
compiled copy of the step per count). With known step counts, the wrap-around schedule of
:mod:`dyndepth._schedule` runs ``C(S) = max(max(steps), ceil(sum(steps) / S))`` iterations; the
count is chosen at run time, once the steps are known, among a short ladder of candidates:
by the time model of :mod:`dyndepth._cost` (:func:`choose_by_time`, the default), or by work
(:func:`choose_by_work`, ``slots="work"``). Continuous batching (stopping steps unknown up
front) takes one count, :func:`refill_slots`. Everything here is a pure function of counts and
of the steps; the kernels never decide a count.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from . import _cost, _sharding
from ._leaves import nbytes
from ._step import Loop

# Each slot count is one compiled copy of the step (forward and backward), so the ladders are
# short: at most MAX_COUNTS counts. The time rule's ladder is ``B``, ``B / 2``, ``B / 4``, ``B / 8``
# (where the best count of common distributions lies: about ``sum / max`` or just below, ``B / 2``
# for uniform depths, ``B / 3`` for a long tail), then a ratio of 4; no count below
# ``fixed_rows / 8`` (an iteration's fixed cost in rows: a count that runs the same iterations
# with up to that many more rows costs within 1 / 8 of it).
MAX_COUNTS = 5
# A large step makes every copy slow to compile: its ladder holds at most LADDER_EQUATIONS
# equations of the step over its counts, two counts at the least, spaced further apart the fewer
# they are (RATIOS: the divisor from each count to the next). Where an iteration's fixed cost is
# small beside its rows, neighbouring counts run alike (benchmarks/recurrent_transformer.py: 3
# counts ran as fast as 5 and compiled in 0.6x the time).
LADDER_EQUATIONS = 512
RATIOS = {5: (2, 2, 2, 4), 4: (2, 4, 4), 3: (4, 4), 2: (4,)}
# The work rule's ladder: ``B``, ``B / 2``, then down by this factor.
WORK_LADDER_RATIO = 8
# The work rule takes a slot count when it executes at most this fraction more than the useful
# steps.
WORK_SLACK = 1 / 16


def slot_candidates(batch: int, fixed_rows: float, step_equations: int = 0,
                    moved_rows: float = 0.0) -> tuple[int, ...]:  # fmt: skip
    """The slot counts that ``slots=None`` chooses from at run time (by :func:`choose_by_time`,
    one compiled branch each), descending, as the comments above say (``step_equations``: the
    step's, :func:`dyndepth._cost.jaxpr_equations`); batches of 2 or fewer run unscheduled.
    A count is kept where its rows with twice their moves (``S x (1 + 2 x moved_rows)``) are
    fewer than the batch's: at its best (lockstep's iterations) it saves more rows than its
    moves cost again. Each count is a compiled copy of the step, forward and backward, and can
    cost a call that runs another: on a TPU v5e, the time rule over five counts took 6.20 ms
    where lockstep alone took 2.60 (B=4096 carries of 16 floats: the TPU compiler relaid the
    store out between the lockstep loop and the scheduled ones), though wider carries ran alike
    (``benchmarks/tpu_slot_costs.py``); one that saves less rarely pays for it. (Where rows
    move for free, every count is kept.)"""
    if batch <= 2:
        return (batch,)
    smallest = max(1, math.floor(fixed_rows / 8))
    counts, c = [batch], batch
    for ratio in RATIOS[ladder_length(step_equations)]:
        c = math.ceil(c / ratio)
        if c < smallest or c == counts[-1]:
            break
        if c * (1 + 2 * moved_rows) < batch:
            counts.append(c)
    return tuple(counts)


def ladder_length(step_equations: int) -> int:
    """The counts of the time rule's ladder for a step of ``step_equations`` equations."""
    return max(2, min(MAX_COUNTS, LADDER_EQUATIONS // max(step_equations, 1)))


def work_candidates(batch: int) -> tuple[int, ...]:
    """The slot counts that ``slots="work"`` chooses from (by :func:`choose_by_work`),
    descending: ``B``, ``B / 2``, ``B / 16``, ``B / 128``, ... (rounded up), then 1; batches
    of 2 or fewer run unscheduled."""
    if batch <= 2:
        return (batch,)
    out, c = [batch], math.ceil(batch / 2)
    while c > 1:
        out.append(c)
        c = math.ceil(c / WORK_LADDER_RATIO)
    return tuple(out) + (1,)


@dataclasses.dataclass(frozen=True)
class SlotRule:
    """How a batch of ``B`` rows picks its slot count at run time: among ``candidates``
    (descending), the one :func:`choose_by_time` (``fixed_rows`` given) or, for
    ``slots="work"`` (``fixed_rows`` None), :func:`choose_by_work` picks."""

    candidates: tuple[int, ...]
    fixed_rows: float | None
    moved_rows: float = 0.0

    @staticmethod
    def of(slots: int | tuple[int, ...] | str | None, batch: int, fixed_rows: float,
           step_equations: int = 0, moved_rows: float = 0.0) -> SlotRule:  # fmt: skip
        """The rule of a loop's ``slots`` argument: the time rule on the default ladder (of a
        step of ``step_equations`` equations), one count, or the given counts (those of
        ``batch`` or more all mean the lockstep batch); ``"work"``: the work rule on its
        ladder."""
        if slots == "work":
            return SlotRule(work_candidates(batch), None)
        if slots is None:
            counts = slot_candidates(batch, fixed_rows, step_equations, moved_rows)
            return SlotRule(counts, fixed_rows, moved_rows)
        counts = (slots,) if isinstance(slots, int) else slots
        counts = tuple(sorted({min(c, batch) for c in counts}, reverse=True))
        return SlotRule(counts, fixed_rows, moved_rows)

    @staticmethod
    def for_loop(loop: Loop, batch: int, consts, c_axes) -> SlotRule:
        """The rule of ``loop`` over ``batch`` rows, its step's fixed cost in rows read from the
        default backend's costs (``consts`` with axis ``None`` in ``c_axes``: the weights every
        iteration reads once), its ladder from the step's size."""
        shared = nbytes([c for c, ax in zip(consts, c_axes, strict=True) if ax is None])
        return _rule_of(loop, batch, _cost.backend_cost(), shared)

    def choose(self, lengths: jax.Array) -> jax.Array:
        if self.fixed_rows is None:
            return choose_by_work(lengths, self.candidates)
        return choose_by_time(lengths, self.candidates, self.fixed_rows, self.moved_rows)


def may_run_scheduled(loop: Loop, rows: int, platform: str) -> bool:
    """Whether a loop over ``rows`` rows may run in fewer slots than rows on ``platform``'s
    costs: its ``slots`` argument's rule has a count below ``rows`` (the ladder read without
    the step's shared weights, which only shorten it)."""
    if loop.strategy != "auto" or rows <= 1:
        return False
    return _rule_of(loop, rows, _cost.backend_cost(platform)).candidates[-1] < rows


def _rule_of(loop: Loop, batch: int, cost: _cost.IterationCost,
             shared_bytes: int = 0) -> SlotRule:  # fmt: skip
    """The rule of ``loop``'s ``slots`` argument over ``batch`` rows under ``cost``: an
    iteration's fixed cost and a row's moves in rows of the step, whose shared operands
    (``shared_bytes``) every iteration reads once."""
    flops = _cost.jaxpr_flops(loop.step_jaxpr.jaxpr)
    size = _cost.jaxpr_equations(loop.step_jaxpr.jaxpr)
    fixed = cost.fixed_rows(flops, shared_bytes)
    return SlotRule.of(loop.slots, batch, fixed, size, cost.moved_rows(flops))


# The axis names of the ``vmap``s that map a kernel over the batch levels outside its rows (see
# dyndepth._dispatch): a choice made at run time is made once across their elements, from the
# worst of theirs. Made per element it would be batched, and a batched conditional runs every
# branch (XLA's select); a chain's loops would each run, masked to the elements that chose it.
_OUTER_LEVELS: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "dyndepth_outer_levels", default=()
)


@contextlib.contextmanager
def outer_level() -> Iterator[str]:
    """While a kernel is traced under one more ``vmap`` over an outer level: the axis name that
    ``vmap`` takes (unique among the levels around it)."""
    names = _OUTER_LEVELS.get()
    name = f"dyndepth_level_{len(names)}"
    token = _OUTER_LEVELS.set((*names, name))
    try:
        yield name
    finally:
        _OUTER_LEVELS.reset(token)


def worst_over_levels(x: jax.Array) -> jax.Array:
    """``x``'s largest value over the elements of the outer levels (``x`` under none): the same
    for every element, so a choice made from it is not batched. Inside a ``shard_map`` (one
    loop per device) ``x`` itself: JAX's collectives there reduce over mesh axes only. Only for
    choices that any value may take (a slot count run forward, or backward where the store is
    not in schedule order)."""
    names = _OUTER_LEVELS.get()
    if not names or _sharding.manual_axes():
        return x
    return jax.lax.pmax(x, names)


def refill_slots(slots: int | tuple[int, ...] | str | None, batch: int,
                 fixed_rows: float | None, moved_rows: float = 0.0) -> int:  # fmt: skip
    """The slot count of continuous batching (stopping steps unknown up front): ``slots``, the
    largest of several; by default (``slots`` None, ``fixed_rows`` given) a quarter of the
    batch, or the whole batch (a lockstep loop that ends with its last sample) where an
    iteration's fixed cost and its rows' moves (in rows, see
    :class:`dyndepth._cost.IterationCost`) outweigh a quarter of its rows: refilling slots then
    costs more in iterations and moves than it saves in rows."""
    if isinstance(slots, int):
        return slots
    if isinstance(slots, tuple):
        return slots[0]
    if slots is None and fixed_rows + moved_rows * batch / 4 >= batch / 4:
        return batch
    return math.ceil(batch / 4)


def iterations(total: jax.Array, longest: jax.Array, slots: int) -> jax.Array:
    """``C``, the iterations of the wrap-around schedule in ``slots`` slots: enough for the
    ``total`` steps, and no fewer than the ``longest`` sample's (its steps run in order)."""
    return jnp.maximum(longest, -(-total // slots))


def executed_steps(lengths: jax.Array, slots: int) -> jax.Array:
    """Sample-steps the wrap-around schedule executes with ``slots`` slots: ``slots x C``."""
    return slots * iterations(jnp.sum(lengths), jnp.max(lengths, initial=0), slots)


def modeled_time(total: jax.Array, longest: jax.Array, slots: int, fixed_rows: float,
                 moved_rows: float = 0.0, lockstep: bool = False):  # fmt: skip
    """The time model of :mod:`dyndepth._cost` in row-steps: ``C x (fixed_rows + slots x (1 +
    moved_rows))``, the moves left out in ``lockstep``."""
    row = 1.0 if lockstep else 1.0 + moved_rows
    return iterations(total, longest, slots).astype(jnp.float32) * (fixed_rows + slots * row)


def choose_by_time(lengths: jax.Array, candidates: tuple[int, ...], fixed_rows: float,
                   moved_rows: float = 0.0):  # fmt: skip
    """Index into ``candidates`` (descending) of the slot count of least modeled time (the
    first, so the most slots, among equals); a count of as many slots as ``lengths`` has rows
    runs in lockstep, without moves. Under outer levels (:func:`outer_level`), of least time
    in their slowest element."""
    rows = lengths.shape[0]
    lengths = lengths.astype(jnp.int32)
    total, longest = jnp.sum(lengths), jnp.max(lengths, initial=0)
    times = jnp.stack([modeled_time(total, longest, c, fixed_rows, moved_rows, c >= rows)
                       for c in candidates])  # fmt: skip
    return jnp.argmin(worst_over_levels(times)).astype(jnp.int32)


def choose_by_work(lengths: jax.Array, candidates: tuple[int, ...]) -> jax.Array:
    """Index into ``candidates`` (descending) of the largest slot count that executes at most
    ``(1 + WORK_SLACK) x sum(lengths)`` sample-steps, else of the one that executes fewest.
    The largest such count runs the fewest iterations; 1 slot always executes exactly the sum,
    so the work bound holds for every distribution of lengths. Under outer levels
    (:func:`outer_level`), the bound holds in each of their elements."""
    lengths = lengths.astype(jnp.int32)
    total = jnp.sum(lengths)
    work = jnp.stack([executed_steps(lengths, c) for c in candidates])
    excess = work.astype(jnp.float32) - (1 + WORK_SLACK) * total.astype(jnp.float32)
    ok = worst_over_levels(excess) <= 0
    pick = jnp.where(jnp.any(ok), jnp.argmax(ok), jnp.argmin(worst_over_levels(work)))
    return pick.astype(jnp.int32)
