"""The stored-carry budget: how many carries a reverse-mode loop keeps for its backward pass.

With ``checkpoints=None`` the forward pass stores the carry before every step, ``max_steps``
carries per sample, as long as the whole loop's buffer (every sample of the batch, every level
of ``vmap``) fits :data:`STORED_CARRY_BUDGET`; above it, a bounded number of checkpoints per
sample, so that a generous ``max_steps`` with small depths never allocates gigabytes. The batch
is only known when a batched loop runs (a batching rule added it), so the budget is applied
there: :func:`fitted` gives the loop a kernel runs, and :func:`matching` the loop whose
backward pass reads a buffer the forward pass stored.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Any

import numpy as np

from ._step import Loop

# Bytes one loop's stored carries may take with ``checkpoints=None``, its batch included, counting
# the two copies the compiled backward pass may hold.
STORED_CARRY_BUDGET = 512 * 2**20


def nbytes(avals) -> int:
    """Bytes of ``avals``: arrays, or abstract values (an array of each); typed PRNG keys
    count their key data (their dtype's ``itemsize``, which ``np.dtype`` cannot read)."""
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in avals)


def bounded_checkpoints(carry_bytes: int, length: int) -> int | None:
    """``None`` while two copies of ``length`` carries of ``carry_bytes`` fit
    :data:`STORED_CARRY_BUDGET` (the compiled backward pass may hold two), else the number of
    checkpoints ``K = ceil(length / S)``, ``S`` a power of two, whose carries with the recompute
    buffers of :func:`recompute_slots` are fewest (the most checkpoints among equals): a loop
    over budget keeps about ``3 x length ** (1/3)`` carries per sample, so that its memory and
    the time spent filling it do not grow with an unused ``length``."""
    fits = STORED_CARRY_BUDGET // max(2 * carry_bytes, 1)
    if carry_bytes == 0 or length <= fits:
        return None
    spacings = [2**e for e in range(max(length - 1, 1).bit_length() + 1)]
    options = [(-(-length // s), s) for s in spacings]
    held = [(k + sum(recompute_slots(s)), -k) for k, s in options]
    return -min(held)[1]


# A segment of checkpoints this long or longer is recomputed in two levels.
TWO_LEVEL_FROM = 64


def recompute_slots(segment: int) -> tuple[int, int]:
    """``(inner, sub)``: the backward pass's buffers for segments of up to ``segment`` steps
    (a power of two): one of ``segment`` carries (``sub = 0``), or, from
    :data:`TWO_LEVEL_FROM` on, sub-checkpoints every ``inner`` steps (``inner`` the power of two
    nearest above ``sqrt(segment)``) and one sub-segment's carries."""
    if segment < TWO_LEVEL_FROM:
        return segment, 0
    inner = 2 ** -(-(segment.bit_length() - 1) // 2)
    return inner, segment // inner


_VARIANTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _with_checkpoints(loop: Loop, checkpoints: int | None) -> Loop:
    """``loop`` storing ``checkpoints`` carries per sample; one object per count, so that
    what is traced per loop is traced once."""
    if checkpoints == loop.checkpoints:
        return loop
    variants = _VARIANTS.setdefault(loop, {})
    if checkpoints not in variants:
        variants[checkpoints] = dataclasses.replace(loop, checkpoints=checkpoints)
    return variants[checkpoints]


def fitted(loop: Loop, batch: tuple) -> Loop:
    """The loop a kernel runs over ``batch`` (its levels, each with a ``size``): with
    ``checkpoints=None``, the checkpoints that keep every sample's stored carries within the
    budget; a count the user chose stays. A symbolic size (``jax.export``) counts as one
    sample: its rows are not known until the program runs."""
    if loop.checkpoints is not None or loop.strategy not in ("auto", "checkpointed"):
        return loop
    rows = math.prod(level.size if isinstance(level.size, int) else 1 for level in batch)
    carry_bytes = nbytes(loop.carry_avals)
    return _with_checkpoints(loop, bounded_checkpoints(rows * carry_bytes, loop.max_steps))


def matching(loop: Loop, buffer_leaf: Any, carry_aval: Any) -> Loop:
    """The loop whose forward pass stored ``buffer_leaf`` (the stored carries of the leaf of
    ``carry_aval``, checkpoint slots on the axis before the carry's own)."""
    if loop.strategy not in ("auto", "checkpointed"):
        return loop
    slots = buffer_leaf.shape[len(buffer_leaf.shape) - len(carry_aval.shape) - 1]
    if slots == loop.slots_stored:
        return loop
    return _with_checkpoints(loop, slots if slots < loop.max_steps else None)
