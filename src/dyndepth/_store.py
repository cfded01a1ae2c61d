"""The carries a forward pass stores for its backward pass, one store for every batched kernel.

Per sample ``b``, at most ``K`` carries (``K`` the loop's
:attr:`dyndepth._step.Loop.slots_stored`), in ``buf[k, b]``: the store is slot-major, ``(K, B,
...)`` (:data:`ROW_AXIS`), so that a lockstep pass, whose rows all write or read one slot per
iteration, moves one contiguous slice, and the scheduled kernels' per-row cells share that one
layout (with a batch-major store, the TPU compiler kept a second, slot-major copy of it beside
wrap-around slot counts: ``benchmarks/tpu_store_layout.py``). Slot ``k`` holds the carry before
step ``k x stride[b]``, ``stride[b]`` the smallest power of two with ``ceil(steps[b] /
stride[b]) <= K`` (1 while the sample's steps fit: every carry). Where the steps are known
before the loop (depths), the strides are set then; where they are not (a stop predicate), a
sample whose ``K`` slots fill up keeps every other carry at twice the stride, which ends in the
same layout. Slot 0 always holds the initial carry, so that a backward pass never evaluates the
step at an unwritten slot.

A forward pass on the wrap-around schedule (:class:`dyndepth._schedule.Wrap`, ``S`` slots of
``B`` rows, ``S`` dividing ``B``) writes its store in *schedule order* where the schedule's
``C`` iterations fit it (``C <= K x B / S``: every carry of every sample then fits, however
deep the sample, in the space of ``K`` carries per sample; checked before the loop where the
store thins, :func:`dyndepth._kernels.forward`): iteration ``t``'s ``S`` slots' carries are one
contiguous block, columns ``(t % q) x S ...`` of slot ``t // q`` (``q = B / S``). A
row-per-slot scatter into a large buffer costs a TPU about 150 ns a row, the block a tenth of
it (``benchmarks/README.md``, "What a TPU scatter costs against the buffer's size"). The
backward pass finds sample ``b``'s carry before step ``i`` through the forward schedule
(:func:`in_order_cells`): the residual ``in_order`` (per sample the forward pass's slot count,
0 for a store kept per sample) says which layout it reads, and the backward pass runs in that
slot count (:class:`dyndepth._dispatch._BackwardPlan`). A map over the samples, which splits
the store by its columns, first gathers it into the per-sample layout (:func:`to_per_sample`).

A thinned store's backward pass recomputes one segment (``stride`` steps) at a time per sample
into a buffer of :func:`recompute_rows` carries per sample, slot-major like the store
(:func:`backward_unit`); a sample whose stride exceeds it (deeper than about ``K ** 2 / 2``
steps) sends its batch to the two-level lockstep sweep of :mod:`dyndepth._batched`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from . import _cost, _schedule, _sharding, _vma
from ._leaves import DROP, IN_BOUNDS, index_in, put_index, update_in
from ._schedule import at_slots
from ._step import Loop

# The stored carries' row axis, after their slot axis: ``(K, B, ...)``, under every level of
# ``vmap`` too (``(K, *rows, ...)``, outermost level first). Each batching rule and map over the
# rows puts the store's row axis here.
ROW_AXIS = 1


def strides_for(lengths: jax.Array, K: int) -> jax.Array:
    """The smallest power of two ``s`` with ``ceil(length / s) <= K``, per sample."""
    need = jnp.maximum(-(-lengths.astype(jnp.int32) // K), 1)  # ceil(length / K), at least 1
    bits = 32 - jax.lax.clz(need - 1)  # (need a power of two: need - 1 has that many bits)
    return jnp.left_shift(jnp.ones_like(need), bits)


def max_stride(loop: Loop) -> int:
    """The largest stride of :func:`strides_for` over ``loop.max_steps`` steps."""
    s = 1
    while -(-loop.max_steps // s) > loop.slots_stored:
        s *= 2
    return s


def recompute_rows(loop: Loop) -> int:
    """Carries per sample the scheduled backward pass recomputes a segment into: up to the
    largest stride's, at most ``K / 2`` (the store's half)."""
    return min(max_stride(loop) - 1, max(loop.slots_stored // 2, 1))


def units(steps: jax.Array, stride: jax.Array) -> jax.Array:
    """The backward pass's units of work per sample (:func:`backward_unit`): ``2 x steps -
    segments`` (every step undone, all but each segment's first step recomputed), ``segments =
    ceil(steps / stride)``; ``steps`` at stride 1."""
    return 2 * steps - (-(-steps // stride))


def backward_unit(steps: jax.Array, stride: jax.Array, u: jax.Array) -> tuple:
    """Unit ``u`` of a sample's backward pass: ``(recompute, step, p, j)``.

    The pass takes the segments last first; segment ``j`` of ``L`` steps, from step ``j x
    stride``, is ``L - 1`` recompute units (the carries before its steps ``1 ... L - 1``, each
    the step applied to the one before) then ``L`` reverse steps, its last step first. A unit
    applies ``step`` to the carry at position ``p`` of its segment: stored slot ``j`` for
    ``p = 0``, else recomputed row ``p - 1``; a recompute unit writes row ``p``."""
    nseg = -(-steps // stride)
    last = steps - (nseg - 1) * stride  # the last segment's steps
    in_last = u < 2 * last - 1
    rest = u - (2 * last - 1)
    per = 2 * stride - 1
    j = jnp.where(in_last, nseg - 1, nseg - 2 - rest // per)
    r = jnp.where(in_last, u, rest % per)
    length = jnp.where(in_last, last, stride)
    recompute = r < length - 1
    p = jnp.where(recompute, r, 2 * length - 2 - r)
    return recompute, j * stride + p, p, j


def start(loop: Loop, init: list, strides: jax.Array | None) -> dict:
    """The store before the first step: ``init`` in slot 0; ``strides`` given (known steps) or
    growing as the slots fill (``None``)."""
    B = strides.shape[0] if strides is not None else init[0].shape[0]
    buf = [update_in(_sharding.blank((loop.slots_stored, B), a), c, 0, 0)
           for a, c in zip(loop.carry_avals, init, strict=True)]  # fmt: skip
    if strides is not None:
        return {"buf": buf, "stride": strides}
    ones = jnp.ones((B,), jnp.int32)
    return {"buf": buf, "stride": ones, "count": jnp.zeros((B,), jnp.int32)}


def put(loop: Loop, store: dict, b: Any, i: jax.Array, carry: list, live: jax.Array) -> dict:
    """Store each live slot's ``carry``, the carry before its sample's step ``i``, where that
    step falls on the sample's stride."""
    if not loop.thinning:  # every carry is stored: slot i
        # (a lockstep row past its steps writes a slot that no backward pass reads: one slice
        # written as it is, no read of the old one and no select)
        want = None if b is None and jnp.ndim(i) == 0 else live
        return dict(store, buf=put_cells(store["buf"], b, i, carry, want, 0))
    if "count" in store:
        store = _make_room(loop, store, b, i, live)
    elif b is None and jnp.ndim(i) == 0 and _cost.conditionals_on_device():
        return _put_shared_step(loop, store, i, carry, live)
    stride = at_slots([store["stride"]], b)[0]
    want = live & (i % stride == 0)
    k = (i // stride) if "count" not in store else at_slots([store["count"]], b)[0]
    buf = put_cells(store["buf"], b, k, carry, want, 0)
    out = dict(store, buf=buf)
    if "count" in store:
        B = store["count"].shape[0]
        out["count"] = store["count"].at[jnp.where(want, _rows_of(b, want), B)].add(1, **DROP)
    return out


def _put_shared_step(loop: Loop, store: dict, i: jax.Array, carry: list, live: jax.Array) -> dict:
    """:func:`put` for rows all at step ``i`` (lockstep) with strides known up front: the rows at
    stride ``s`` (a power of two) all write slot ``i // s`` where ``s`` divides ``i``, so each
    stride is one slice write masked to its rows (for ``s > 1`` a conditional, run where some
    row has that stride; not on a GPU, see :func:`dyndepth._cost.conditionals_on_device`). No
    per-row scatter: a TPU ran one over the whole store, relaid out, every iteration (a store
    sized by a generous ``max_depth`` cost 43 ms an iteration at depth 3 on a v5e:
    ``benchmarks/README.md``, "An unused ``max_depth`` on the TPU v5e")."""
    stride = store["stride"]
    buf = put_index(store["buf"], i, carry, live & (stride == 1))
    for e in range(1, max_stride(loop).bit_length()):
        mine = live & (stride == 1 << e)

        def write(buf, e=e, mine=mine):
            return put_index(buf, jax.lax.shift_right_logical(i, e), carry, mine)

        # (strides are powers of two: a shift and a mask, no division)
        due = ((i & ((1 << e) - 1)) == 0) & jnp.any(stride == 1 << e)
        buf = _vma.cond(due, write, lambda buf: buf, buf)
    return dict(store, buf=buf)


def fits_in_order(iterations: Any, slots: int, K: int, B: int) -> Any:
    """Whether a wrap-around schedule of ``iterations`` in ``slots`` slots fits a store of ``K``
    slots of ``B`` rows in schedule order."""
    return iterations <= K * (B // slots)


def put_in_order(store: dict, t: jax.Array, carry: list, slots: int) -> dict:
    """Iteration ``t``'s slots' ``carry`` (the carries before their steps) as one block of the
    store in schedule order (a dynamic update slice, no scatter); the slots past the
    schedule's positions write cells no backward pass reads."""
    at = _block_at(t, slots, store["buf"][0].shape[ROW_AXIS])

    def put(x, v):
        start = at + (0,) * (v.ndim - 1)
        return jax.lax.dynamic_update_slice(x, v[None], start, allow_negative_indices=False)

    return dict(store, buf=[put(x, v) for x, v in zip(store["buf"], carry, strict=True)])


def _block_at(t: jax.Array, slots: Any, B: int) -> tuple:
    """``(k, first column)`` of iteration ``t``'s block (``t >= 0``) in a store of ``B`` rows
    written in schedule order in ``slots`` slots (a count, or the array of a forward pass's)."""
    q = B // slots
    # (on a TPU each scalar operation is a kernel of its own every iteration, and a signed
    # division takes three: a shift and a mask where the count allows, else the unsigned forms)
    if isinstance(q, int) and q & (q - 1) == 0:
        return jax.lax.shift_right_logical(t, q.bit_length() - 1), (t & (q - 1)) * slots
    return jax.lax.div(t, q), jax.lax.rem(t, q) * slots


def in_order_cells(sched: Any, B: int, b: jax.Array, i: jax.Array) -> tuple:
    """``(k, column)`` of sample ``b``'s carry before step ``i`` in a store of ``B`` rows the
    forward schedule ``sched`` wrote in schedule order (see :func:`put_in_order`)."""
    t, s = sched.position(b, i)
    k, first = _block_at(t, sched.slots, B)
    return k, first + s


def to_per_sample(buf: list, stride: jax.Array, in_order: jax.Array, steps: jax.Array) -> tuple:
    """``(buf, stride)`` of a store (slot-major, one row axis) laid out per sample, as a forward
    pass that stored per sample would have left it; a store in schedule order (``in_order``,
    per sample the slot count it was written in) is gathered into that layout: slot ``k`` of
    sample ``b`` the carry before step ``k x stride[b]`` (:func:`strides_for`), its last step's
    where that is past its steps. A map over the samples splits the store by its columns, where
    only the per-sample layout keeps a sample's carries (``vmap(jacrev(f))``: the cotangents
    batched inside the forward pass's batch). A sample without steps gets the first carry of
    one with steps: a point of a trajectory, where a backward pass may evaluate the step."""
    K, B = buf[0].shape[0], steps.shape[0]
    steps = steps.astype(jnp.int32)
    slots = jnp.max(in_order, initial=0)
    has = steps > 0

    def gathered(args):
        buf, stride = args
        per = strides_for(steps, K)
        b = jnp.where(has, jnp.arange(B), jnp.argmax(steps))[None, :]
        i = jnp.where(has, jnp.minimum(jnp.arange(K)[:, None] * per, steps - 1), 0)
        C, start, head = _schedule.wrap_runs(steps, slots)
        t, s = _schedule.wrap_position(start[b], steps[b], head[b], C, i)
        k, first = _block_at(t, slots, B)
        return [x.at[k, first + s].get(**IN_BOUNDS) for x in buf], per

    # (one store in schedule order per device, or none: a conditional, not a select of both)
    return _vma.cond((slots > 0) & jnp.any(has), gathered, lambda args: args, (buf, stride))


def read(store_buf: list, b: Any, k: jax.Array) -> list:
    """``buf[k[s], b[s]]`` for every buffer of a store (``b`` None: row ``s``)."""
    return cells(store_buf, b, k, 0)


def read_in_loop(store_buf: list, b: Any, k: jax.Array, t: jax.Array) -> list:
    """:func:`read` from the body of a loop whose iteration is ``t``, the store unchanged by
    the loop; the per-row cells (``b`` given) of floating leaves with their bits or'ed with a
    zero the compiler cannot fold (``t``'s sign bit, ``t >= 0``): the same bits.

    A step whose products take a narrower type (a TPU's default precision, bfloat16) converts
    the carries it reads; gathered as they are, the TPU compiler moves that conversion before
    the gather and out of the loop, onto the whole store: a second, bfloat16 copy of it and a
    pass over all of it on every call, whatever the depths (on a TPU v5e, 9.7 ms of the long
    tail's 83 ms with every carry stored, a 4 GiB store, and 2 GiB more memory:
    ``benchmarks/README.md``). A slice (``b`` None, lockstep) stays in the loop as it is,
    except where its layout is not the step's and the store is large
    (:func:`dyndepth._cost.rows_on_lanes`: on a TPU v5e, B=4096 carries of 16 floats
    under a ``max_depth`` of 10,000 took 15 ms a call, 14 of them converting a 2 GiB store into
    8 GiB before the loop). (An arithmetic zero would do too, but ``x - 0.0`` flushes a
    subnormal ``x`` on a CPU.)"""
    cells = read(store_buf, b, k)
    zero = jax.lax.shift_right_logical(t, jnp.asarray(31, t.dtype))  # (t >= 0: its sign bit)
    hide = [jnp.issubdtype(x.dtype, jnp.floating)
            and (b is not None or _cost.rows_on_lanes(x.shape, x.dtype))
            for x in store_buf]  # fmt: skip
    return [_or_bits(c, zero) if h else c for c, h in zip(cells, hide, strict=True)]


@jax.custom_jvp
def _or_bits(x: jax.Array, zero: jax.Array) -> jax.Array:
    """``x`` with its bits or'ed with ``zero``; differentiated as the identity it is (a bit
    cast alone has no derivative: forward over reverse would see a zero tangent)."""
    bits = jnp.dtype(f"int{8 * x.dtype.itemsize}")
    raw = jax.lax.bitcast_convert_type(x, bits) | zero.astype(bits)
    return jax.lax.bitcast_convert_type(raw, x.dtype)


@_or_bits.defjvp
def _or_bits_jvp(primals, tangents):
    x, zero = primals
    return _or_bits(x, zero), tangents[0]


def _rows_of(b: Any, like: jax.Array) -> jax.Array:
    return jnp.arange(like.shape[0]) if b is None else b


def cells(bufs: list, b: Any, k: jax.Array, axis: int) -> list:
    """Each slot ``s``'s cell of every buffer: row ``b[s]`` (``b`` None: row ``s``), position
    ``k[s]`` on ``axis``: 0 for a slot-major ``(K, B, ...)`` buffer (a store), 1 for a
    batch-major ``(B, T, ...)`` one (per-sample xs and ys). One shared ``k`` with ``b`` None
    reads a slice (no gather)."""
    return [_cell(x, b, k, axis) for x in bufs]


def _cell(x: jax.Array, b: Any, k: jax.Array, axis: int) -> jax.Array:
    if b is None and jnp.ndim(k) == 0:
        return index_in(x, k, axis)
    rows = jnp.arange(x.shape[1 - axis]) if b is None else b
    k = jnp.clip(jnp.broadcast_to(k, rows.shape), 0, x.shape[axis] - 1)
    return x.at[(k, rows) if axis == 0 else (rows, k)].get(**IN_BOUNDS)


def put_cells(bufs: list, b: Any, k: jax.Array, values: list, want: Any,
              axis: int) -> list:  # fmt: skip
    """``buf`` at row ``b[s]``, position ``k[s]`` on ``axis`` (see :func:`cells`) set to
    ``value[s]`` where ``want``; one shared ``k`` with ``b`` None is a slice write (a dynamic
    update slice, not a scatter), of every row where ``want`` is None."""
    if b is None and jnp.ndim(k) == 0:
        return put_index(bufs, k, values, want, axis=axis)
    rows = _rows_of(b, want)
    drop = jnp.where(want, rows, bufs[0].shape[1 - axis] if bufs else 0)
    k = jnp.broadcast_to(k, rows.shape)
    at = (k, drop) if axis == 0 else (drop, k)
    return [x.at[at].set(v, **DROP) for x, v in zip(bufs, values, strict=True)]


def _make_room(loop: Loop, store: dict, b: Any, i: jax.Array, live: jax.Array) -> dict:
    """Before storing: samples whose ``K`` slots are full and that store at this step keep
    every other carry at twice the stride (rare: a ``cond`` skips it otherwise)."""
    K = loop.slots_stored
    stride, count = at_slots([store["stride"], store["count"]], b)
    full = live & (i % stride == 0) & (count == K)
    rows = _rows_of(b, full)

    def thin(s):
        kept = (K + 1) // 2
        drop = jnp.where(full, rows, s["count"].shape[0])

        def halve(x):
            mine = x.at[:, rows].get(**IN_BOUNDS)
            pad = jnp.zeros((K - kept,) + mine.shape[1:], mine.dtype)
            return x.at[:, drop].set(jnp.concatenate([mine[0::2], pad]), **DROP)

        return dict(
            buf=[halve(x) for x in s["buf"]],
            stride=s["stride"].at[drop].set(stride * 2, **DROP),
            count=s["count"].at[drop].set(kept, **DROP),
        )

    return _vma.cond(jnp.any(full), thin, lambda s: s, store)
