"""Small helpers over flat lists of leaves and over a leading batch (row) axis."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

Leaves = list[Any]

# Options of ``x.at[idx]``'s gathers and scatters for the indices a loop body computes, never
# negative: no wrap of negative indices (on a TPU its compare and select are a kernel of their
# own every loop iteration). IN_BOUNDS: every index in range; DROP: rows out of range dropped.
IN_BOUNDS = dict(mode="promise_in_bounds", wrap_negative_indices=False)
DROP = dict(mode="drop", wrap_negative_indices=False)


def is_diff(x: Any) -> bool:
    """Whether ``x`` has a floating (differentiable) dtype."""
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def take(leaves: Sequence[Any], mask: Sequence[bool], want: bool = True) -> Leaves:
    """The leaves whose mask entry equals ``want``."""
    return [leaf for leaf, m in zip(leaves, mask, strict=True) if m == want]


def merge(chosen: Sequence[Any], others: Sequence[Any], mask: Sequence[bool]) -> Leaves:
    """Inverse of :func:`take`: ``chosen`` where ``mask``, ``others`` elsewhere, in order."""
    a, b = iter(chosen), iter(others)
    return [next(a) if m else next(b) for m in mask]


def fill(chosen: Sequence[Any], mask: Sequence[bool], other: Any = None) -> Leaves:
    """``chosen`` where ``mask``, ``other`` elsewhere."""
    return merge(chosen, [other] * (len(mask) - sum(mask)), mask)


def rows_mask(mask: Any, x: jax.Array) -> jax.Array:
    """Broadcast a (B,) mask (or a :class:`RowsBelow`) against a (B, ...) array."""
    if isinstance(mask, RowsBelow):
        return mask.like(x)
    return mask.reshape(mask.shape + (1,) * (jnp.ndim(x) - 1))


# Rows of at most this many elements are narrow (see :class:`RowsBelow`).
NARROW = 8


@dataclasses.dataclass(frozen=True)
class RowsBelow:
    """The rows' mask ``i < bound``, a shared ``i`` against a per-row ``bound``, which a loop
    body compares with narrow leaves (rows of 2 to :data:`NARROW` elements) as ``i < wide``:
    ``wide`` maps such a leaf's shape to the bound broadcast to it before the loop (see
    :func:`wide_bounds`). XLA's CPU backend emits a select whose (B,) mask is broadcast to
    rows of a few elements inside a loop body as scalar code, against vector code for a mask
    of the leaf's own shape: 1.5x the time of the select at 8 elements a row, where wider
    rows are faster broadcast (``benchmarks/cpu_row_mask.py``). ``&`` and ``~`` give the
    plain (B,) mask."""

    i: jax.Array
    bound: jax.Array
    wide: dict

    @property
    def rows(self) -> jax.Array:
        return self.i < self.bound

    @property
    def shape(self) -> tuple:
        return self.bound.shape

    def like(self, x: jax.Array) -> jax.Array:
        wide = self.wide.get(jnp.shape(x))
        return self.i < wide if wide is not None else rows_mask(self.rows, x)

    def __and__(self, other: Any) -> jax.Array:
        return self.rows & other

    __rand__ = __and__

    def __invert__(self) -> jax.Array:
        return ~self.rows


def wide_bounds(bound: jax.Array, leaves: Sequence[Any]) -> dict:
    """:attr:`RowsBelow.wide` for the narrow ones of ``leaves`` (arrays of the shapes a loop
    will mask, each with a row axis of ``bound``'s ``B`` rows), computed where this is called:
    before the loop. Each is the bound broadcast, with the bound's sharding and the manual axes
    it varies over, not the leaf's: leaves of one shape share it (a carry part split over a
    model axis beside a replicated one), and a mask varying over an axis its leaf does not
    would make the leaf vary over it too (its cotangent then summed over that axis)."""
    B = bound.shape[0]
    out = {}
    for x in leaves:
        shape = jnp.shape(x)
        if len(shape) >= 2 and shape[0] == B and 1 < math.prod(shape[1:]) <= NARROW:
            out.setdefault(shape, jnp.broadcast_to(rows_mask(bound, x), shape))
    return out


def where_rows(mask: jax.Array, new: Sequence[Any], old: Sequence[Any]) -> Leaves:
    return [jnp.where(rows_mask(mask, a), a, b) for a, b in zip(new, old, strict=True)]


def index_in(x: jax.Array, i: jax.Array, axis: int) -> jax.Array:
    """``x[..., i, ...]`` at ``axis``, ``i`` in range (no wrap of a negative index: on a TPU
    its add, compare and select are scalar kernels of their own every loop iteration)."""
    return lax.dynamic_index_in_dim(x, i, axis, keepdims=False, allow_negative_indices=False)


def update_in(x: jax.Array, value: jax.Array, i: jax.Array, axis: int) -> jax.Array:
    """``x[..., i, ...] = value`` at ``axis``, ``i`` in range (see :func:`index_in`)."""
    return lax.dynamic_update_index_in_dim(x, value, i, axis, allow_negative_indices=False)


def idle_rows_at(live: jax.Array, row: jax.Array, leaves: Sequence[Any], axes=None) -> Leaves:
    """The leaves with a row axis (axis 0 where ``axes`` says 0; ``axes`` None: every leaf)
    with their rows that are not ``live`` replaced by row ``row``'s, a live row: a batched
    step's idle rows then run at the inputs of a step some sample takes, where its Jacobian is
    finite if that sample's is (a carry the loop never reached may make it NaN, and ``0 x NaN``
    would poison a shared parameter's gradient, summed over the rows)."""
    axes = [0] * len(leaves) if axes is None else axes
    return [jnp.where(rows_mask(live, x), x, index_in(x, row, 0)) if ax == 0 else x
            for x, ax in zip(leaves, axes, strict=True)]  # fmt: skip


def at_index(bufs: Sequence[Any], i: jax.Array, axis: int = 0) -> Leaves:
    """``buf[i]`` at ``axis`` for every buffer (no batch axis, or a step-major one: ``(T, B,
    ...)``; ``axis=1``: a batch-major ``(B, T, ...)`` one's column)."""
    return [index_in(b, i, axis) for b in bufs]


def put_index(bufs: Sequence[Any], i: jax.Array, vals: Sequence[Any], mask=None,
              axis: int = 0) -> Leaves:  # fmt: skip
    """``buf[i] = val`` at ``axis`` for every buffer (no batch axis); with a (B,) ``mask``, of a
    step-major ``(T, B, ...)`` buffer (or a batch-major one's column, ``axis=1``), only the rows
    where it holds (a dynamic update of one slice: step-major, what a TPU writes fastest, about
    10 times a scatter of the same rows)."""
    if mask is not None:
        vals = where_rows(mask, vals, at_index(bufs, i, axis))
    return [update_in(b, v, i, axis) for b, v in zip(bufs, vals, strict=True)]


def expand(leaves: Sequence[Any], axis: int = 0) -> Leaves:
    """Every leaf with a row axis of one at ``axis``."""
    return [jnp.expand_dims(x, axis) for x in leaves]


def squeeze(leaves: Sequence[Any], axis: int = 0) -> Leaves:
    """Every leaf's only row, at ``axis``."""
    return [lax.index_in_dim(x, 0, axis, keepdims=False) for x in leaves]


def broadcast_rows(leaves: Sequence[Any], batched: Sequence[bool], rows: int,
                   axis: int = 0) -> Leaves:  # fmt: skip
    """Give every unbatched leaf a row axis of ``rows`` at ``axis`` (a broadcast, not a copy
    in XLA)."""

    def spread(x):
        shape = jnp.shape(x)
        return jnp.broadcast_to(jnp.expand_dims(x, axis), shape[:axis] + (rows,) + shape[axis:])

    return [x if b else spread(x) for x, b in zip(leaves, batched, strict=True)]


def nbytes(avals) -> int:
    """Bytes of ``avals``: arrays, or abstract values (an array of each); typed PRNG keys
    count their key data (their dtype's ``itemsize``, which ``np.dtype`` cannot read)."""
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in avals)
