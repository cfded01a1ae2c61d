"""Schedules: which sample, and which of its steps, each slot of a batched loop runs.

A batched loop applies the step to ``S`` *slots* at every iteration (static shapes). A schedule
says, per iteration ``t``, for every slot ``s``: the sample ``b[s]`` it runs, that sample's step
``i[s]``, and whether the slot is ``live`` (idle slots run the step on some sample's values
and discard it). Every sample keeps its carry in its own row of the batch (``cur[b]``), read
by the slot that runs it and written back after the step, so a slot that moves on to another
sample, or a sample whose steps are split between two slots, needs no further bookkeeping.

* :class:`Lockstep`: ``S = B``, slot ``s`` runs sample ``s`` at step ``t`` until its steps are
  done (a known count, or its stop predicate fails); ``b`` is the identity (no gather).
* :class:`Wrap`: known step counts in ``S < B`` slots, McNaughton's wrap-around rule. The
  samples' steps are laid end to end, ``W = sum(steps)`` positions, cut into ``S`` runs of
  ``C = max(max(steps), ceil(W / S))`` iterations: slot ``s`` runs positions ``[s C, (s + 1)
  C)``. A sample cut by a slot boundary runs its first steps at the start of the next slot and
  its last ones at the end of its own (``steps <= C``, so the first part ends before the second
  starts; its carry waits in its row). Executed sample-steps are ``S x C``: below ``W + S``
  when ``S <= W / max(steps)``. Backward passes run the samples' reverse sweeps on the same
  rule.
* :class:`Refill`: stopping steps known only when a sample stops (a ``while_loop``'s forward
  pass): continuous batching; a slot takes the next pending sample the moment its sample stops.

The per-sample numbers a wrap-around slot needs (where its sample starts, its length, where it
is cut, the next sample) are packed in one table read with one gather per iteration.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from . import _vma
from ._leaves import DROP, IN_BOUNDS, RowsBelow, where_rows, wide_bounds
from ._slots import iterations


@dataclasses.dataclass(frozen=True)
class Turn:
    """A loop's turn in a chain of loops run one after another, of which at most one runs: the
    slot counts of a ladder (:func:`dyndepth._dispatch._ladder`). The loop runs only where
    ``runs``, from the loop ``state`` the previous loop left (as that one found it where it did
    not run; None: the first, a fresh state). One state passed through the loops, where a
    conditional would choose among them, lets the compiler keep it where it keeps a lone
    loop's: on a TPU v5e, a weight's cotangent in the chip's fast memory (a conditional's
    output was not: a long tail took 1.19x the time of its chosen count alone;
    benchmarks/README.md, "One chain of loops, no conditional")."""

    runs: Any = True
    state: dict | None = None

    def gate(self, running: jax.Array) -> jax.Array:
        return running if self.runs is True else self.runs & running


# A lone loop's turn: it runs, from a fresh state.
ALONE = Turn()


def at_slots(leaves: list, b: Any) -> list:
    """Each slot's row of the per-sample ``leaves``: ``leaf[b[s]]`` (``b`` in range); ``b``
    None: the rows themselves (a lockstep slot is its sample)."""
    if b is None:
        return list(leaves)
    return [x.at[b].get(**IN_BOUNDS) for x in leaves]


def put_slots(leaves: list, b: Any, values: list, live: jax.Array) -> list:
    """``leaf[b[s]] = value[s]`` for the live slots (no two live slots share a sample)."""
    if b is None:
        return where_rows(live, values, leaves)
    drop = jnp.where(live, b, leaves[0].shape[0] if leaves else 0)
    return [x.at[drop].set(v, **DROP) for x, v in zip(leaves, values, strict=True)]


@dataclasses.dataclass(frozen=True)
class Slots:
    """One iteration's view of the slots: sample ``b`` (None: slot ``s`` is sample ``s``), its
    step ``i`` (a scalar when every slot is at the same step), whether the slot is ``live``;
    ``after``: the schedule's state at the next iteration, where the step's results do not
    decide it.

    A slot that is not live still evaluates the step (or its vjp), at the inputs of row
    ``read`` (``b`` unless set), and discards the result. A backward pass makes them the inputs
    of a step some sample took: a carry the loop never stepped from (a sample with no steps)
    may make the step's Jacobian NaN, and ``0 x NaN`` would poison a shared parameter's
    gradient, summed over the slots. ``fill`` (a row, with ``b`` None and a shared ``i``):
    the slots read their own rows at step ``i``, and the idle ones then take row ``fill``'s
    inputs instead, a step that sample takes (reads stay slices, not gathers)."""

    b: Any
    i: jax.Array
    live: jax.Array
    after: dict = dataclasses.field(default_factory=dict)
    read: Any = "b"
    fill: Any = None

    @property
    def rows(self) -> Any:
        """The rows whose inputs the slots read."""
        return self.b if isinstance(self.read, str) else self.read


# ----------------------------------------------------------------------------- lockstep


@dataclasses.dataclass(frozen=True)
class Lockstep:
    """Every sample in its own slot, at step ``t``, until its ``lengths`` steps are done;
    ``reverse``: the samples' reverse sweeps, ``i`` the forward step being undone.

    A reverse sweep ``at_end`` undoes the same step ``T - 1 - t`` in every slot (``T`` the
    longest length): the samples' sweeps end together, so every per-sample read and write
    is at one shared step (a slice of the stored carries, not a gather), and a sample whose
    sweep has not begun idles at the longest sample's inputs. Otherwise the sweeps start
    together (each slot's own unit ``t``: a thinned store's units)."""

    lengths: jax.Array
    reverse: bool = False
    at_end: bool = False
    wide: dict = dataclasses.field(default_factory=dict)  # (see masking)
    # (computed once, before the loop: in its body they would be reductions every iteration)
    iterations: jax.Array = dataclasses.field(init=False)
    longest: jax.Array = dataclasses.field(init=False)  # a sample with that many steps

    def __post_init__(self):
        longest = jnp.argmax(self.lengths) if self.slots else jnp.zeros((), jnp.int32)
        object.__setattr__(self, "iterations", jnp.max(self.lengths, initial=0))
        object.__setattr__(self, "longest", longest)

    @property
    def slots(self) -> int:
        return self.lengths.shape[0]

    def masking(self, leaves: list) -> Lockstep:
        """This schedule, its masks of one shared step (``i < lengths``) compared with the narrow
        ones of ``leaves`` (the arrays of the shapes the loop masks) without a broadcast in the
        loop: :class:`dyndepth._leaves.RowsBelow`. Call it before the loop."""
        return dataclasses.replace(self, wide=wide_bounds(self.lengths, leaves))

    def _below(self, i: jax.Array) -> Any:
        return RowsBelow(i, self.lengths, self.wide) if self.wide else i < self.lengths

    def start(self, init: list) -> dict:
        return {}

    def running(self, state: dict, t: jax.Array) -> jax.Array:
        return t < self.iterations

    def view(self, state: dict, t: jax.Array) -> Slots:
        if not self.reverse:
            return Slots(None, t, self._below(t))
        if self.at_end:
            i = self.iterations - 1 - t
            return Slots(None, i, self._below(i), fill=self.longest if self.slots else None)
        # A sample already done reads its step 0; one with no steps, a sample's that has some.
        src = jnp.where(self.lengths > 0, jnp.arange(self.slots), self.longest)
        i = jnp.maximum(self.lengths.at[src].get(**IN_BOUNDS) - 1 - t, 0)
        return Slots(None, i, t < self.lengths, read=src)

    def advance(self, state: dict, view: Slots, carry: list) -> dict:
        return view.after

    def steps(self, state: dict) -> jax.Array:
        return self.lengths


# ----------------------------------------------------------------------------- wrap-around


# Rows of the per-sample table: where the sample's positions start, how many it has, how many
# of them its first slot holds (its last steps; all of them unless it is cut), the next
# sample with steps (the last sample when none: a slot that moves past it is idle).
_START, _LENGTH, _HEAD, _AFTER = range(4)


@dataclasses.dataclass(frozen=True)
class Wrap:
    """The wrap-around schedule of samples with known ``lengths`` in ``slots`` slots;
    ``reverse``: each sample's steps in reverse order (a backward pass), ``i`` then the forward
    step being undone."""

    slots: int
    iterations: jax.Array
    total: jax.Array
    table: jax.Array  # (4, B) int32: _START, _LENGTH, _HEAD, _AFTER
    first: jax.Array  # (S,) the sample holding each slot's first position
    reverse: bool = False

    @staticmethod
    def of(lengths: jax.Array, slots: int, reverse: bool = False, runs: Any = True) -> Wrap:
        """``runs``: whether the schedule's loop will run (:attr:`Turn.runs`); where it will
        not, its per-sample table and the slots' first samples are left zeros, under a
        conditional (a chain's every count sets up its schedule, one count runs)."""
        B = lengths.shape[0]
        S = max(1, min(slots, B))
        length = lengths.astype(jnp.int32)
        C = iterations(jnp.sum(length), jnp.max(length, initial=0), S)
        if runs is True:
            table, first = wrap_table(length, S, C)
        else:
            zeros = lambda: (jnp.zeros((4, B), jnp.int32), jnp.zeros((S,), jnp.int32))  # noqa: E731
            table, first = _vma.cond(runs, lambda: wrap_table(length, S, C), zeros)
        return Wrap(S, C, jnp.sum(length), table, first, reverse)

    def masking(self, leaves: list):
        return self

    def start(self, init: list) -> dict:
        return {"b": self.first}

    def running(self, state: dict, t: jax.Array) -> jax.Array:
        return t < self.iterations

    def view(self, state: dict, t: jax.Array) -> Slots:
        b = state["b"]
        start, length, head, after = self.table.at[:, b].get(**IN_BOUNDS)
        g = jnp.arange(self.slots, dtype=jnp.int32) * self.iterations + t
        u = g - start  # the position within the sample's run of positions
        step = jnp.where(u >= head, u - head, u + length - head)
        i = length - 1 - step if self.reverse else step
        # (an idle slot reads a step of its sample's: a point of its trajectory)
        i = jnp.clip(i, 0, jnp.maximum(length - 1, 0))
        # A slot whose sample's run ends moves on to the next sample with steps (after the
        # last iteration it does not matter where it would go).
        return Slots(b, i, g < self.total, {"b": jnp.where(u == length - 1, after, b)})

    def advance(self, state: dict, view: Slots, carry: list) -> dict:
        return view.after

    def steps(self, state: dict) -> jax.Array:
        return self.table[_LENGTH]

    def position(self, b: jax.Array, i: jax.Array) -> tuple:
        """``(t, s)``: the iteration and the slot at which this (forward) schedule runs step
        ``i`` of sample ``b`` (``i`` within its steps), per element."""
        start, length, head, _ = self.table.at[:, b].get(**IN_BOUNDS)
        return wrap_position(start, length, head, self.iterations, i)


def wrap_table(length: jax.Array, S: int, C: jax.Array) -> tuple:
    """``(table, first)`` of the wrap-around schedule of ``length`` steps per sample in ``S``
    slots over ``C`` iterations: per sample (``(4, B)``) where its run of positions starts, its
    steps, how many of them its first slot holds and the next sample with steps; per slot the
    sample holding its first position."""
    B = length.shape[0]
    start, head = wrap_starts(length, C)
    end = start + length
    # The next sample with steps; past the last one, the last one (an idle slot then reads
    # the inputs of a step that sample took).
    has = jnp.where(length > 0, jnp.arange(B, dtype=jnp.int32), B)
    last = jnp.maximum(jnp.max(jnp.where(length > 0, jnp.arange(B), 0), initial=0), 0)
    after = jnp.concatenate([jax.lax.cummin(has[::-1])[::-1][1:], jnp.full((1,), B)])
    after = jnp.where(after >= B, last, after)
    # The sample holding each slot's first position: the count of samples ending at or before
    # it (a comparison of S x B, once: cheaper to trace and run than a search).
    first = jnp.sum(end[None, :] <= (jnp.arange(S) * C)[:, None], axis=1, dtype=jnp.int32)
    first = jnp.where(first >= B, last, first)
    return jnp.stack([start, length, head, after.astype(jnp.int32)]), first


def wrap_runs(length: jax.Array, slots: Any) -> tuple:
    """``(C, start, head)`` of the wrap-around schedule of ``length`` steps per sample in
    ``slots`` slots (a count, or an array: the slot count a forward pass ran in): its
    iterations, and per sample where its run of positions starts and how many of them its first
    slot holds (its last steps; all of them unless it is cut)."""
    C = iterations(jnp.sum(length), jnp.max(length, initial=0), slots)
    return (C, *wrap_starts(length, C))


def wrap_starts(length: jax.Array, C: jax.Array) -> tuple:
    """``(start, head)`` of :func:`wrap_runs` for a schedule of ``C`` iterations."""
    start = jnp.cumsum(length) - length
    cut = (start // jnp.maximum(C, 1) + 1) * C
    return start, jnp.where(start + length > cut, cut - start, length)


def wrap_position(start, length, head, C, i) -> tuple:
    """``(t, s)``: the iteration and slot of step ``i`` of a sample of ``length`` steps whose run
    starts at ``start`` with ``head`` positions in its first slot (:func:`wrap_runs`), on a
    wrap-around schedule of ``C`` iterations."""
    # (a cut sample's first steps follow its run's first ``head`` positions: its last steps)
    g = start + jnp.where(i < length - head, i + head, i + head - length)
    C = jnp.maximum(C, 1)
    return g % C, g // C


# ----------------------------------------------------------------------------- stop predicates


@dataclasses.dataclass(frozen=True)
class LockstepWhile:
    """Every sample in its own slot, stepping while ``i < bound`` and ``holds(carry)`` (the
    stop predicate, over the rows); a sample that stops never steps again, so every live slot
    is at step ``t``."""

    bound: jax.Array
    holds: Any  # (b, carry) -> (S,) bool, or None without a predicate

    @property
    def slots(self) -> int:
        return self.bound.shape[0]

    def masking(self, leaves: list):
        return self

    def start(self, init: list) -> dict:
        i = jnp.zeros(self.bound.shape, jnp.int32)
        return {"i": i, "act": self._active(i, init)}

    def _active(self, i, carry) -> jax.Array:
        act = i < self.bound
        return act if self.holds is None else act & self.holds(None, carry)

    def running(self, state: dict, t: jax.Array) -> jax.Array:
        return jnp.any(state["act"])

    def view(self, state: dict, t: jax.Array) -> Slots:
        return Slots(None, t, state["act"])

    def advance(self, state: dict, view: Slots, carry: list) -> dict:
        i = state["i"] + view.live.astype(jnp.int32)
        return {"i": i, "act": view.live & self._active(i, carry)}

    def steps(self, state: dict) -> jax.Array:
        return state["i"]


@dataclasses.dataclass(frozen=True)
class Refill:
    """Continuous batching in ``slots`` slots: samples enter in ``order`` (the ``pending``
    ones, those with steps to take, first); a slot whose sample stops (``i >= bound[b]`` or the
    predicate fails) takes the next pending sample at once."""

    slots: int
    bound: jax.Array
    holds: Any
    order: jax.Array
    pending: jax.Array

    def masking(self, leaves: list):
        return self

    def start(self, init: list) -> dict:
        B = self.bound.shape[0]
        first = self.order[: self.slots]
        return dict(
            b=first,
            i=jnp.zeros((self.slots,), jnp.int32),
            live=jnp.arange(self.slots, dtype=jnp.int32) < self.pending,
            next=jnp.asarray(self.slots, jnp.int32),
            steps=jnp.zeros((B,), jnp.int32),
        )

    def running(self, state: dict, t: jax.Array) -> jax.Array:
        return jnp.any(state["live"])

    def view(self, state: dict, t: jax.Array) -> Slots:
        return Slots(state["b"], state["i"], state["live"])

    def advance(self, state: dict, view: Slots, carry: list) -> dict:
        b, live = view.b, view.live
        i = view.i + live.astype(jnp.int32)
        stop = i >= self.bound.at[b].get(**IN_BOUNDS)
        if self.holds is not None:
            stop = stop | ~self.holds(b, carry)
        done = live & stop
        steps = state["steps"].at[jnp.where(done, b, self.bound.shape[0])].set(i, **DROP)
        # The freed slots take the next pending samples, in order.
        pos = state["next"] + jnp.cumsum(done, dtype=jnp.int32) - 1
        take = done & (pos < self.pending)
        new_b = self.order.at[jnp.minimum(pos, self.order.shape[0] - 1)].get(
            mode="promise_in_bounds"
        )
        return dict(
            b=jnp.where(take, new_b, b),
            i=jnp.where(done, 0, i),
            live=jnp.where(done, take, live),
            next=state["next"] + jnp.sum(done, dtype=jnp.int32),
            steps=steps,
        )

    def steps(self, state: dict) -> jax.Array:
        return state["steps"]
